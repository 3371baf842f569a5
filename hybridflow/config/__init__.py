"""The serve config's ``args``: deployments of worker groups, declared, validated here.

One deployment is one single controller (a Serve deployment) that owns the groups
declared under it::

    deployments:
      - name: counters
        groups:
          - name: counter
            worker: my_pkg.workers:Counter        # module:Class
            init_kwargs: {start: 5}
            pool: {process_on_nodes: [2], use_gpu: auto, name_prefix: c}
            read_only: [get]
          - name: counter_view
            worker: my_pkg.workers:Viewer
            pool: {same_as: counter}               # the same bundles, processes of its own
        models:
          - {name: my_model, group: counter, method: get, inputs: [...], outputs: [...]}

Validation needs no Ray: :func:`load_config` checks the shape with pydantic, then what
the shape cannot say (names that refer to other names, worker classes that import and
are Workers, models whose method exists), and raises :class:`ConfigError` whose message
names every problem by its path in the config (``deployments[counters].groups[counter].
pool.same_as: ...``).
"""


from __future__ import annotations

from hybridflow.config.groups import (
    NAME_PATTERN,
    RESERVED_DEPLOYMENTS,
    BackoffConfig,
    BatchingConfig,
    ConfigError,
    DeploymentConfig,
    GroupConfig,
    InitCall,
    MegatronConfig,
    ModelConfig,
    PoolConfig,
    SupervisionConfig,
    TensorSpec,
)
from hybridflow.config.loading import colocations, import_worker, load_config, pool_root
from hybridflow.config.service import LimitsConfig, ServiceConfig
from hybridflow.config.state import STATE_FRESH_ENV, STATE_PATH_ENV, StateConfig
from hybridflow.state.store import DEFAULT_STATE_PATH, REDIS_SCHEMES

__all__ = [
    "DEFAULT_STATE_PATH",
    "NAME_PATTERN",
    "REDIS_SCHEMES",
    "RESERVED_DEPLOYMENTS",
    "STATE_FRESH_ENV",
    "STATE_PATH_ENV",
    "BackoffConfig",
    "BatchingConfig",
    "ConfigError",
    "DeploymentConfig",
    "GroupConfig",
    "InitCall",
    "LimitsConfig",
    "MegatronConfig",
    "ModelConfig",
    "PoolConfig",
    "ServiceConfig",
    "StateConfig",
    "SupervisionConfig",
    "TensorSpec",
    "colocations",
    "import_worker",
    "load_config",
    "pool_root",
]
