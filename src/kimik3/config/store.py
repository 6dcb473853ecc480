"""The one place that registers kimik3's schemas with Hydra's ConfigStore.

`conf/` files name these in their defaults list (`base_config` for the primary config,
`base_model` / `base_train` / `base_data` inside each group), so every YAML value is checked
against the dataclass type and an unknown key is rejected at compose time.
"""

from hydra.core.config_store import ConfigStore

from kimik3.config.schema import DataConfig, ModelConfig, PrepareConfig, RootConfig, TrainConfig


def register_configs() -> None:
    """Register the schemas; idempotent, called before Hydra composes."""
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=RootConfig)
    cs.store(name="base_prepare", node=PrepareConfig)
    cs.store(group="model", name="base_model", node=ModelConfig)
    cs.store(group="train", name="base_train", node=TrainConfig)
    cs.store(group="data", name="base_data", node=DataConfig)
