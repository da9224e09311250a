"""Launching: the ``overlap`` command line, torchrun and local processes
(``launch.env.init``, ``launch.local``), and a pool of Ray actors (``launch.ray_pool``).

Ray is imported only when a pool is built, and Triton only when a kernel launches.
"""

from launch.env import LaunchError, init, launcher, rank_environment


def __getattr__(name: str):
    if name in ("RayPool", "PoolError"):  # Ray loads only when asked for
        from launch import ray_pool

        return getattr(ray_pool, name)
    raise AttributeError(name)


__all__ = ["LaunchError", "PoolError", "RayPool", "init", "launcher", "rank_environment"]
