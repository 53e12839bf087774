"""Prompts in: files and iterables read and checked (`files`), rendered and streamed (`prompts`)."""

from grpokit.data.files import CSV_TYPES, SUFFIXES, load_prompts
from grpokit.data.prompts import PromptStream, columns_of, prompt_batches, render_prompt
from grpokit.errors import DataError

__all__ = ["CSV_TYPES", "SUFFIXES", "DataError", "PromptStream", "columns_of", "load_prompts", "prompt_batches",
           "render_prompt"]
