"""Checkpoint conversion between Hugging Face folders and our Megatron Core checkpoints, checked by logits.

    python launch.py convert hf-to-megatron --hf DIR --out DIR [--tp N --pp N --ep N]
    python launch.py convert megatron-to-hf --ckpt DIR --out DIR [--shard-size 2GB] [--verify]

Modules: ``names`` (name map, pure Python), ``mapping`` (tensor fusions), ``safetensors_io`` (HF folders),
``dist_reader`` (layout-free checkpoint reads), ``export``, ``importer``, ``streamed_save`` (the import's
save, reading each shard from the HF files as it is written), ``verify``, ``spawn``/``worker`` (torchrun
processes) and ``model_build`` (CPU and meta-device model building incl. MoE with TP>1).
Tests: ``.venv/bin/python -m pytest tests/test_conversion*.py -q``.

Importing this package does not import torch; the functions below import what they need when called.
"""


def export_checkpoint_to_hf(*args, **kwargs):
    """See ``megatron_rl.conversion.export.export_checkpoint_to_hf``."""
    from megatron_rl.conversion.export import export_checkpoint_to_hf as export

    return export(*args, **kwargs)


def import_hf_to_megatron(*args, **kwargs):
    """See ``megatron_rl.conversion.importer.import_hf_to_megatron``."""
    from megatron_rl.conversion.importer import import_hf_to_megatron as run

    return run(*args, **kwargs)


def verify_export(*args, **kwargs):
    """See ``megatron_rl.conversion.verify.verify_export``."""
    from megatron_rl.conversion.verify import verify_export as run

    return run(*args, **kwargs)


__all__ = ["export_checkpoint_to_hf", "import_hf_to_megatron", "verify_export"]
