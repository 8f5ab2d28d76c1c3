"""Job configuration: the dataclass schema, the YAML/override loader and the cross-section checks."""

from megatron_rl.spec.config.loader import load_config, to_yaml
from megatron_rl.spec.config.schema import JobConfig

__all__ = ["JobConfig", "load_config", "to_yaml"]
