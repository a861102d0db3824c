"""reputd configuration: defaults < YAML file < ``REPUTD_*`` environment variables < explicit overrides.

Store keys keep RocketMQ's MessageStoreConfig names so operators can copy them from broker.conf. The sizes
that shape files on disk must equal the broker's, or the rebuilt ConsumeQueue/IndexFile will not match it.
Every value is validated as it is read, so a mistake is reported with the dotted key and where it came from.

The package, one module per job: model.py (the dataclasses a configuration is, ConfigError), keys.py (the
key table), validate.py (one value against its key), yamlfile.py (reading the file), layers.py (defaults <
file < environment < overrides, and `load_config`), memo.py (a query's remembered parse of the file). This
module names what the rest of reputd imports.
"""

from __future__ import annotations

from daemon.config.keys import BROKER_RUNTIME_STORE_KEYS, UNSUPPORTED_STORE_SETTINGS
from daemon.config.layers import config_path, default_config, load_config
from daemon.config.model import (
    BUILTIN_DISPATCHERS,
    CONFIG_ENV,
    CQ_STORE_UNIT_SIZE,
    DEFAULT_CONFIG_FILE,
    DEFAULT_S3_REQUEST_TIMEOUT_SECONDS,
    ENV_IGNORED,
    ENV_PREFIX,
    ON_CORRUPTION_SKIP_SEGMENT,
    ON_CORRUPTION_STOP,
    ROOT_DIR_PLACEHOLDER,
    BackfillConfig,
    Config,
    ConfigError,
    DispatcherSpec,
    LoggingConfig,
    MetricsConfig,
    OutputConfig,
    ReputConfig,
    RetentionConfig,
    StoreConfig,
    env_var_name,
)
from indexcore.dispatch import DELAY_UNIT_MS, parse_delay_levels

__all__ = [
    "BROKER_RUNTIME_STORE_KEYS",
    "BUILTIN_DISPATCHERS",
    "CONFIG_ENV",
    "CQ_STORE_UNIT_SIZE",
    "DEFAULT_CONFIG_FILE",
    "DEFAULT_S3_REQUEST_TIMEOUT_SECONDS",
    "DELAY_UNIT_MS",
    "ENV_IGNORED",
    "ENV_PREFIX",
    "ON_CORRUPTION_SKIP_SEGMENT",
    "ON_CORRUPTION_STOP",
    "ROOT_DIR_PLACEHOLDER",
    "UNSUPPORTED_STORE_SETTINGS",
    "BackfillConfig",
    "Config",
    "ConfigError",
    "DispatcherSpec",
    "LoggingConfig",
    "MetricsConfig",
    "OutputConfig",
    "ReputConfig",
    "RetentionConfig",
    "StoreConfig",
    "config_path",
    "default_config",
    "env_var_name",
    "load_config",
    "parse_delay_levels",
]
