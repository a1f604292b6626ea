"""Importing this module registers the torchtitan train specs "llama3_commopt", "deepseek_v3_commopt"
and "qwen3_commopt".

Name it in the job config so that every rank imports it before the trainer looks the spec up:

    [experimental]
    custom_import = "torch_commopt.integrations.torchtitan.register"
"""

from torch_commopt.integrations.torchtitan.spec import TRAIN_SPEC_NAME, register

register()

__all__ = ["TRAIN_SPEC_NAME"]
