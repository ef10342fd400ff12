"""The answering LLM's prompt and budget."""

from __future__ import annotations

from dataclasses import dataclass

from .utils import check_at_least, check_fields, option, prompt_text


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
        check_fields(self)
        check_at_least(self, 1, "max_context_tokens", "max_answer_tokens")
        check_at_least(self, 0, "answer_temperature")
        if self.answer_prompt_file:
            prompt_text(self.answer_prompt_file)
        return self
