"""The answering LLM's prompt and budget."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import QCGError
from .utils import option, prompt_text


@dataclass
class AnswerConfig:
    max_context_tokens: int = option(
        6000, "Context cap in tokens (cl100k_base) for the retrieved chunks (paper: 6000)."
    )
    max_answer_tokens: int = option(256, "Longest answer, in LLM tokens.")
    answer_temperature: float = option(0.0, "Sampling temperature of the answering LLM (0 = greedy).")
    answer_prompt_file: str | None = option(
        None,
        "A UTF-8 text file holding the answering system prompt (another language, a domain); keep its instruction "
        "to reply 'Insufficient information' when the excerpts do not say, or abstentions go unrecognised.",
    )

    def validate(self) -> AnswerConfig:
        if self.max_context_tokens < 1 or self.max_answer_tokens < 1:
            raise QCGError(
                f"max_context_tokens and max_answer_tokens must be >= 1, got {self.max_context_tokens}, "
                f"{self.max_answer_tokens}"
            )
        if self.answer_temperature < 0:
            raise QCGError(f"answer_temperature must be >= 0, got {self.answer_temperature}")
        if self.answer_prompt_file:
            prompt_text(self.answer_prompt_file)
        return self
