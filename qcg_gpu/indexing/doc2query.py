"""Extended Doc2Query (METHOD.md, index step 2): M question-answer pairs per chunk.

The prompt, the JSON schema the LLM is held to, and a parser that keeps every
valid pair of whatever comes back (short lists, duplicates, empty strings,
truncated or non-JSON text) and counts what it dropped.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from dataclasses import dataclass, field

from ..config import GenerationConfig, prompt_text
from ..llm.backends import SamplingSpec

PROMPT_VERSION = 2

# The system prompts --prompt chooses from. Each one's text enters the generation cache key, so a
# stored generation replays only under the prompt it was made with; never edit a released one.
SYSTEM_PROMPTS = {
    # The first prompt (the SmolLM2 generation of benchmarks/lihuaworld was made with it).
    "basic": (
        "You write question-answer pairs for a search index. Every question must be answerable from the given text "
        "alone, "
        "and every answer must be a short exact span or fact from the text. Questions must be distinct and cover "
        "different "
        "facts (who, what, when, where, why). Reply with JSON only."
    ),
    # Questions a user would ask of the whole collection: each about one fact of the text and naming who
    # and what it is about, since a node is matched against user queries without its chunk.
    "self-contained": (
        "You write question-answer pairs for a search index over a large collection of chat logs and documents. Each "
        "pair is about one specific fact stated in the given text: an event, plan, time, date, place, object, number, "
        "opinion or reason. Each question must make sense on its own, without the text: name the people and things it "
        "is about instead of 'he', 'they' or 'the text'. Each answer is a short span copied from the text. Do not ask "
        "who someone is or what their name is. Questions must be distinct. Reply with JSON only."
    ),
    # One pair per fact, answered by the sentence that states it: a node then carries the chunk's own
    # words as well as a question (LiHuaWorld probe, 16 dev questions, Qwen2.5-Coder-1.5B at M = 10: the
    # evidence chunk ranked first for 81% of them against 56% with 'basic' at M = 20).
    "quoted": (
        "You write question-answer pairs for a search index over a large collection of chat logs and documents. Write "
        "one pair for each distinct fact the text states: a plan, event, request, suggestion, time, date, place, "
        "object, number, opinion or reason. The question asks about that fact and names the people and things it is "
        "about, never 'he', 'they' or 'the text'. The answer is the sentence of the text that states the fact, copied "
        "word for word. Do not ask for anyone's name or identity. Every pair is about a different fact. Reply with "
        "JSON only."
    ),
}
# No worked example: small models copy an example's facts into every reply (measured with
# SmolLM2-135M: the example's bakery showed up in unrelated chunks), and the JSON schema
# already fixes the format.


def user_prompt(text: str, m: int) -> str:
    return f"Write {m} question-answer pairs about this text.\n\nText:\n{text}"


def system_prompt(config: GenerationConfig) -> str:
    """The rules: the --prompt-file's text, else the built-in prompt --prompt names."""
    return prompt_text(config.prompt_file) if config.prompt_file else SYSTEM_PROMPTS[config.prompt]


def build_conversation(text: str, m: int, system: str = SYSTEM_PROMPTS["basic"]) -> list[dict]:
    """Chat messages for one chunk: the rules (:func:`system_prompt`), then the chunk."""
    return [{"role": "system", "content": system}, {"role": "user", "content": user_prompt(text, m)}]


def pairs_schema(config: GenerationConfig) -> dict:
    """JSON schema of the reply: exactly M pairs; string caps keep a small model from rambling to max_tokens."""
    item = {
        "type": "object",
        "properties": {
            "question": {"type": "string", "minLength": 1, "maxLength": config.max_question_chars},
            "answer": {"type": "string", "minLength": 1, "maxLength": config.max_answer_chars},
        },
        "required": ["question", "answer"],
        "additionalProperties": False,
    }
    return {
        "type": "object",
        "properties": {"pairs": {"type": "array", "items": item, "minItems": config.m, "maxItems": config.m}},
        "required": ["pairs"],
        "additionalProperties": False,
    }


def sampling_spec(config: GenerationConfig) -> SamplingSpec:
    config.settle()
    assert config.repetition_penalty is not None and config.compact_json is not None  # settle() filled them
    # ~4 characters per token, plus JSON punctuation per pair; generous so a full reply is never cut.
    per_pair = config.max_pair_tokens or (config.max_question_chars + config.max_answer_chars) // 3 + 16
    return SamplingSpec(
        temperature=config.temperature,
        top_p=config.top_p,
        max_tokens=config.max_tokens or config.m * per_pair + 32,
        seed=config.seed,
        repetition_penalty=config.repetition_penalty,
        json_schema=pairs_schema(config) if config.structured_output else None,
        compact_json=config.compact_json,
    )


def cache_key(text: str, model_name: str, config: GenerationConfig) -> str:
    """Content hash of everything that decides a chunk's pairs."""
    identity = {
        "text": text,
        "model": model_name,
        "prompt": [PROMPT_VERSION, system_prompt(config), user_prompt("", config.m)],
        "m": config.m,
        # compact_json enters the key only when on, so keys made before it existed stay valid
        "sampling": {k: v for k, v in sampling_spec(config).__dict__.items() if k != "compact_json" or v},
        **({"engine": engine} if (engine := config.reply_engine_settings()) else {}),
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


@dataclass
class ParsedPairs:
    pairs: list[tuple[str, str]] = field(default_factory=list)
    dropped: Counter = field(default_factory=Counter)  # reason -> count


_SPACES = re.compile(r"\s+")


def _normalise(s: str) -> str:
    return _SPACES.sub(" ", s).strip()


def _candidate_items(text: str):
    """Dicts found in ``text``: the parsed reply when it is valid JSON, else every complete object in it."""
    try:
        reply = json.loads(text)
    except json.JSONDecodeError:
        reply = None
    if isinstance(reply, dict) and isinstance(reply.get("pairs"), list):
        return reply["pairs"], False
    if isinstance(reply, list):
        return reply, False
    # Truncated or chatty output: salvage each complete {...} that decodes on its own.
    decoder, items, pos = json.JSONDecoder(), [], 0
    while (pos := text.find("{", pos)) != -1:
        try:
            obj, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            pos += 1
            continue
        if isinstance(obj, dict) and "pairs" in obj and isinstance(obj["pairs"], list):
            items += obj["pairs"]
        elif isinstance(obj, dict):
            items.append(obj)
        pos = end
    return items, True


def parse_pairs(text: str, m: int) -> ParsedPairs:
    """Valid, distinct (question, answer) pairs of an LLM reply, at most ``m``, with drop counts.

    Each item of the reply is counted once: kept, or dropped for one reason (``invalid_item``,
    ``empty``, ``duplicate``, ``beyond_m``); ``short_of_m`` counts the items a reply of fewer than
    ``m`` lacked. So kept + invalid + empty + duplicate + short_of_m == m whenever no item is beyond m."""
    result = ParsedPairs()
    items, salvaged = _candidate_items(text)
    if salvaged:
        result.dropped["malformed_json"] += 1
    seen = set()
    for item in items:
        if (
            not isinstance(item, dict)
            or not isinstance(item.get("question"), str)
            or not isinstance(item.get("answer"), str)
        ):
            result.dropped["invalid_item"] += 1
            continue
        question, answer = _normalise(item["question"]), _normalise(item["answer"])
        if not question or not answer:
            result.dropped["empty"] += 1
            continue
        key = (question.casefold(), answer.casefold())
        if key in seen:
            result.dropped["duplicate"] += 1
            continue
        if len(result.pairs) == m:
            result.dropped["beyond_m"] += 1
            continue
        seen.add(key)
        result.pairs.append((question, answer))
    if len(items) < m:  # pairs the reply never wrote (items it wrote but we dropped are counted above, once)
        result.dropped["short_of_m"] += m - len(items)
    return result
