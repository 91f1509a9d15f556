"""Datasets for RL: local preprocessors (gsm8k, MATH-lighteval, DAPO-Math-17k, synthetic), the prompt loader
and a resumable sampler. Schema and differences from verl: docs/data.md and each module's docstring.
"""

from .cli import add_prepare_data_args, main_prepare_data
from .loader import PromptDataset, PromptRecord, load_prompts, report_filtered
from .prepare import INSTRUCTION, VALID_KINDS, prepare_data
from .sampler import PromptSampler

__all__ = [
    "INSTRUCTION",
    "VALID_KINDS",
    "PromptDataset",
    "PromptRecord",
    "PromptSampler",
    "add_prepare_data_args",
    "load_prompts",
    "main_prepare_data",
    "prepare_data",
    "report_filtered",
]
