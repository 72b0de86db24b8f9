"""A compile-only H100 for XLA's deviceless (ahead-of-time) GPU compilation.

Needs JAX's CUDA plugin (``pip install "jax[cuda12]"``), which installs without a GPU; on a
machine without one, set ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`` before JAX is imported (the
plugin otherwise fails its CUDA checks and does not register). Used by
``benchmarks/fp8_deviceless.py`` and ``tests/lax/test_fp8_gpu.py``.
"""

from __future__ import annotations

import jax
from jax.experimental import topologies

# The device XLA compiles for: an H100 SXM (132 SMs, 227 KiB of shared memory per block, 50 MiB
# of L2, 80 GB of HBM3 at 3.35 TB/s).
H100_TARGET = """
gpu_device_info {
  cuda_compute_capability { major: 9 minor: 0 }
  core_count: 132
  fpus_per_core: 128
  threads_per_warp: 32
  threads_per_block_limit: 1024
  threads_per_core_limit: 2048
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  shared_memory_per_block: 49152
  shared_memory_per_block_optin: 232448
  shared_memory_per_core: 233472
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  l2_cache_size: 52428800
  memory_bandwidth: 3352320000000
  device_memory_size: 84929347584
  clock_rate_ghz: 1.98
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 8 }
runtime_version { major: 12 minor: 9 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""


def h100_sharding() -> jax.sharding.NamedSharding:
    """A replicated sharding on one compile-only H100."""
    topology = topologies.get_topology_desc(platform="cuda", target_config=H100_TARGET, topology="1x1x1")
    mesh = topologies.make_mesh(topology, (1,), ("d",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
