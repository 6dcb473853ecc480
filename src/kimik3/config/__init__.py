"""Config schemas (schema.py), their Hydra registration (store.py) and cross-field checks (validate.py)."""
