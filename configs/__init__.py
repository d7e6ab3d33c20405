"""Configs: the schema (configs/schema.py), the loader (configs/loader.py), what is derived from a loaded config
(configs/resolve.py) and the example YAML files.

    from configs import cli, resolve_stages
    cfg, dry = cli(sys.argv[1:], "what this script does")
    for stage in resolve_stages(cfg): ...
"""

from configs.loader import ConfigError, cli, find_config_file, from_dict, normalize, piece_config, read_yaml
from configs.resolve import answer_help, derive, dry_run, entry, resolve_stages, to_yaml
from configs.schema import Config, ExperienceBufferConfig, FormatConfig, TasksetConfig

__all__ = [
    "Config",
    "ConfigError",
    "ExperienceBufferConfig",
    "FormatConfig",
    "TasksetConfig",
    "answer_help",
    "cli",
    "derive",
    "dry_run",
    "entry",
    "find_config_file",
    "from_dict",
    "normalize",
    "piece_config",
    "read_yaml",
    "resolve_stages",
    "to_yaml",
]
