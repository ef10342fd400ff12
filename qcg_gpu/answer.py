"""Answering (METHOD.md, retrieval step 5): the top-K chunks and the question go to an LLM,
the context capped at ``max_context_tokens``; all questions in one batched call."""

from __future__ import annotations

from .config import AnswerConfig, prompt_text
from .indexing.chunking import load_tokenizer
from .llm.backends import Completion, LLMBackend, SamplingSpec

ABSTAIN = "Insufficient information"

ANSWER_SYSTEM_PROMPT = (
    "You answer questions about a collection of documents, using only the document excerpts given with the "
    "question. Answer briefly and directly. If the excerpts do not contain the answer, reply exactly: "
    f"{ABSTAIN}."
)


def build_context(chunk_texts: list[str], max_tokens: int, tokenizer_name: str = "cl100k_base") -> str:
    """Chunks in rank order, numbered, until the token budget is spent (the last one cut to fit)."""
    tokenizer = load_tokenizer(tokenizer_name)
    parts, budget = [], max_tokens
    for rank, text in enumerate(chunk_texts, 1):
        starts = tokenizer.token_starts(text)
        if budget <= 0:
            break
        if len(starts) > budget:
            text = text[: starts[budget]]
        budget -= min(len(starts), budget)
        parts.append(f"[{rank}]\n{text.strip()}")
    return "\n\n".join(parts)


def build_answer_conversation(question: str, context: str, system: str = ANSWER_SYSTEM_PROMPT) -> list[dict]:
    return [
        {"role": "system", "content": system},
        {"role": "user", "content": f"Document excerpts:\n{context or '(none)'}\n\nQuestion: {question}"},
    ]


def answer_questions(
    llm: LLMBackend, questions: list[str], contexts: list[str], config: AnswerConfig
) -> list[Completion]:
    sampling = SamplingSpec(
        temperature=config.answer_temperature, top_p=1.0, max_tokens=config.max_answer_tokens, seed=0
    )
    return llm.chat(answer_conversations(questions, contexts, config), sampling)


def answer_conversations(questions: list[str], contexts: list[str], config: AnswerConfig) -> list[list[dict]]:
    """One chat per question: the system prompt (--answer-prompt-file's text, else ours), the excerpts, the question."""
    system = prompt_text(config.answer_prompt_file) if config.answer_prompt_file else ANSWER_SYSTEM_PROMPT
    return [build_answer_conversation(q, c, system) for q, c in zip(questions, contexts)]


def answer_from_chunks(
    llm: LLMBackend, questions: list[str], chunk_ids: list[list[int]], chunk_texts: list[str], config: AnswerConfig
) -> list[Completion]:
    """Each question answered from the texts of its ranked chunks (``chunk_ids``, best first)."""
    contexts = [build_context([chunk_texts[c] for c in ranked], config.max_context_tokens) for ranked in chunk_ids]
    return answer_questions(llm, questions, contexts, config)
