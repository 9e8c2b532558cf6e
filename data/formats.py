"""Instruction and preference data formats: each one a small function (a normaliser) that turns one record of it
into the canonical sample data/samples.py renders, registered in base/registry.py FORMATS under the source kind
that names it. A source's `kind` picks its normaliser; `kind: auto` detects it from the first record's keys. A
record a normaliser cannot read is refused in one line naming its file and line (or JSON array item), with the
format it looks like when that is another one. TRL's data_utils is the model: its formats are read as it writes
them, and `conversations` of from/value turns become `messages` as its maybe_convert_to_chatml does.

The canonical instruction sample (SFT, PPO's prompts) is one of three shapes:
  {"instruction", "input", "output"}   the template's prompt (prompt_input / prompt_no_input), then the output
  {"prompt", "completion"}             the prompt as it is (no template), then the completion
  {"messages": [{role, content}, ..]}  turns: system and user by the template, every assistant turn a response
The canonical preference pair (the reward model, DPO): {"chosen", "rejected", "margin"} with its prompt as
{"instruction", "input"} (templated) or {"prompt"} (as it is), or chosen and rejected as message lists that hold
the prompt themselves.

A new format is one function here, decorated with `@fmt(name, pairs, keys, looks_like)`; docs/extending.md shows one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

from base.registry import FORMATS
from data.errors import DataError

AUTO = "auto"  # the kind whose format is detected from the first record's keys
ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
HH_TURN = {"\n\nHuman:": "user", "\n\nAssistant:": "assistant"}  # Anthropic HH's transcript markers


class NoPreference(DataError):
    """A preference record that prefers neither response: refused, or left out and counted under
    data.sources[].ties=drop (a tie carries no signal for a pairwise loss)."""


@dataclass(frozen=True)
class Format:
    name: str
    pairs: Optional[bool]  # preference pairs (rm, dpo), instruction samples (sft, ppo); None: auto, either
    keys: str  # what a record holds, for refusals and docs
    looks_like: Callable[[dict], bool]  # detection (kind auto, and the hint when a record is in another format)
    normalise: Optional[Callable[[dict, str], dict]]  # (record, where) -> the canonical sample or pair


def fmt(name: str, pairs: bool, keys: str, looks_like: Callable[[dict], bool]):
    """Register the decorated normaliser as the format `name` (its source kind)."""
    def add(normalise):
        FORMATS.add(name, Format(name, pairs, keys, looks_like, normalise))
        return normalise
    return add


def kinds(pairs: bool) -> Tuple[str, ...]:
    """The source kinds that hold preference pairs (pairs=True) or instruction samples, auto included."""
    return tuple(name for name in FORMATS if FORMATS[name].pairs in (pairs, None))


def detect(record: dict) -> Optional[Format]:
    """The format the record looks like (the first registered one whose keys it has)."""
    return next((FORMATS[n] for n in FORMATS if FORMATS[n].normalise and FORMATS[n].looks_like(record)), None)


def format_of(kind: str, record: object, where: str) -> Format:
    """The format of a source of `kind` whose first record is `record` (read at `where`)."""
    if kind != AUTO:
        return FORMATS[kind]
    found = detect(_object(record, where))
    if found is None:
        raise DataError(f"{where}: kind auto found no format for keys {_keys(record)}; the formats: "
                        f"{', '.join(n for n in FORMATS if FORMATS[n].normalise)} (docs/sft.md shows their keys)")
    return found


def normalise(form: Format, record: object, where: str) -> dict:
    return form.normalise(_object(record, where), where)


# --- shared checks ---------------------------------------------------------------------------------------------

def _object(record: object, where: str) -> dict:
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    return record


def _keys(record: dict) -> str:
    return ", ".join(sorted(record))[:200]


def _need(record: dict, where: str, name: str, *keys: str) -> None:
    """Every key of `keys` is in the record, or a refusal naming the first missing one, the format's keys and the
    format the record looks like instead."""
    for key in keys:
        if key not in record:
            other = detect(record)
            hint = f"; it looks like a {other.name} record: set kind: {other.name} (or kind: auto)" \
                if other and other.name != name else ""
            raise DataError(f"{where}: no field '{key}' (keys: {_keys(record)}); a record of kind {name} holds "
                            f"{FORMATS[name].keys}{hint}")


def _text(record: dict, where: str, key: str, default: Optional[str] = None) -> str:
    value = record.get(key, default)
    if not isinstance(value, str):
        raise DataError(f"{where}: field '{key}' is {type(value).__name__}, expected a string")
    return value


def _response(text: str, where: str, what: str) -> str:
    if not text.strip():
        raise DataError(f"{where}: empty response; every sample needs a non-empty {what} to learn from")
    return text


def _is_messages(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) and "role" in m for m in value)


def _messages(value: object, where: str, what: str = "'messages'") -> List[dict]:
    if not isinstance(value, list) or not all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                              and m.get("role") in ROLES for m in value):
        raise DataError(f"{where}: {what} must be a list of {{role: system|user|assistant, content: str}}")
    responses = [m["content"] for m in value if m["role"] == "assistant"]
    if not responses or not all(r.strip() for r in responses):
        raise DataError(f"{where}: empty response; every sample needs a non-empty assistant turn to learn from")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _pair(where: str, chosen, rejected, margin: object = 0.0, **prompt) -> dict:
    """The canonical pair, checked: responses both text (then a prompt) or both message lists, different, and
    a margin >= 0."""
    if isinstance(chosen, list) and isinstance(rejected, list):
        chosen = _messages(chosen, where, "'chosen'")
        rejected = _messages(rejected, where, "'rejected'")
    elif isinstance(chosen, str) and isinstance(rejected, str):
        if not (chosen.strip() and rejected.strip()):
            raise DataError(f"{where}: empty response; chosen and rejected must both be non-empty")
    else:
        raise DataError(f"{where}: 'chosen' and 'rejected' must both be strings or both be chat message lists")
    if chosen == rejected:
        raise DataError(f"{where}: chosen and rejected are identical, so the pair says nothing; drop it")
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not margin >= 0:
        raise DataError(f"{where}: 'margin' must be a number >= 0, got {margin!r}")
    return {**prompt, "chosen": chosen, "rejected": rejected, "margin": float(margin)}


def _prompt(record: dict, where: str) -> dict:
    """A text pair's prompt: {"instruction", "input"} (the template's prompt) or {"prompt"} (as it is)."""
    if "instruction" in record:
        return {"instruction": _text(record, where, "instruction"), "input": _text(record, where, "input", "")}
    return {"prompt": _text(record, where, "prompt")}


# --- instruction samples ---------------------------------------------------------------------------------------

@fmt("alpaca", False, "{instruction, input (optional), output} (Stanford Alpaca)",
     lambda r: "instruction" in r and "output" in r)
def alpaca(record: dict, where: str) -> dict:
    _need(record, where, "alpaca", "instruction", "output")
    return {"instruction": _text(record, where, "instruction"), "input": _text(record, where, "input", ""),
            "output": _response(_text(record, where, "output"), where, "output")}


@fmt("sharegpt", False, "{conversations: [{from: system|human|gpt, value}, ...], system (optional)} (ShareGPT)",
     lambda r: "conversations" in r)
def sharegpt(record: dict, where: str) -> dict:
    _need(record, where, "sharegpt", "conversations")
    turns = record["conversations"]
    if not isinstance(turns, list) or not all(isinstance(t, dict) and isinstance(t.get("value"), str) for t in turns):
        raise DataError(f"{where}: 'conversations' must be a list of {{from, value: str}}")
    strange = sorted({str(t.get("from")) for t in turns} - set(SHAREGPT_ROLES))
    if strange:
        raise DataError(f"{where}: 'from' is {strange[0]!r}; ShareGPT turns come from {', '.join(SHAREGPT_ROLES)}")
    system = [{"role": "system", "content": _text(record, where, "system")}] if record.get("system") else []
    return {"messages": _messages(system + [{"role": SHAREGPT_ROLES[t["from"]], "content": t["value"]}
                                            for t in turns], where, "'conversations'")}


@fmt("chat", False, "{messages: [{role: system|user|assistant, content}, ...]}", lambda r: "messages" in r)
def chat(record: dict, where: str) -> dict:
    _need(record, where, "chat", "messages")
    return {"messages": _messages(record["messages"], where)}


@fmt("prompt_completion", False, "{prompt, completion} (text, or TRL's message lists)",
     lambda r: "prompt" in r and "completion" in r)
def prompt_completion(record: dict, where: str) -> dict:
    _need(record, where, "prompt_completion", "prompt", "completion")
    if _is_messages(record["prompt"]) and _is_messages(record["completion"]):  # TRL's conversational form
        return {"messages": _messages(record["prompt"] + record["completion"], where, "'prompt' + 'completion'")}
    return {"prompt": _text(record, where, "prompt"),
            "completion": _response(_text(record, where, "completion"), where, "completion")}


# --- preference pairs --------------------------------------------------------------------------------------------

def _hh_like(record: dict) -> bool:
    return isinstance(record.get("chosen"), str) and record["chosen"].startswith("\n\nHuman:") and \
        "prompt" not in record and "instruction" not in record


def _extract_prompt(chosen: str, rejected: str) -> int:
    """Where the shared prompt of two text responses ends: TRL's extract_prompt (the first differing character,
    less a space before it, which goes with the responses)."""
    idx = 0
    for idx in range(min(len(chosen), len(rejected))):
        if chosen[idx] != rejected[idx]:
            if chosen[idx - 1] == " ":
                idx -= 1
            break
    return idx


@fmt("preference", True, "{prompt or instruction (+ input), chosen, rejected, margin (optional)}, or chosen and "
     "rejected as message lists (TRL's preference formats)",
     lambda r: "chosen" in r and "rejected" in r and not _hh_like(r))
def preference(record: dict, where: str) -> dict:
    _need(record, where, "preference", "chosen", "rejected")
    chosen, rejected, margin = record["chosen"], record["rejected"], record.get("margin", 0.0)
    if _is_messages(record.get("prompt")) and isinstance(chosen, list) and isinstance(rejected, list):
        return _pair(where, record["prompt"] + chosen, record["prompt"] + rejected, margin)  # TRL's explicit prompt
    if isinstance(chosen, str) and isinstance(rejected, str) and "instruction" not in record and \
            "prompt" not in record:  # TRL's implicit prompt: the shared beginning
        cut = _extract_prompt(chosen, rejected)
        if cut <= 0:
            raise DataError(f"{where}: no prompt; chosen and rejected share no beginning, so a pair with text "
                            f"responses needs 'instruction' (with optional 'input') or 'prompt'")
        return _pair(where, chosen[cut:], rejected[cut:], margin, prompt=chosen[:cut])
    return _pair(where, chosen, rejected, margin, **({} if isinstance(chosen, list) else _prompt(record, where)))


@fmt("feedback", True, "{prompt, response1, response2, preference: 1 or 2} (human feedback: which response is better)",
     lambda r: {"response1", "response2", "preference"} <= set(r))
def feedback(record: dict, where: str) -> dict:
    """The prompt is an instruction (the template wraps it, as the reward model's input is built from it)."""
    _need(record, where, "feedback", "prompt", "response1", "response2", "preference")
    choice = record["preference"]
    if isinstance(choice, bool) or choice not in (1, 2):
        raise NoPreference(f"{where}: 'preference' is {choice!r}; it says which response is better, 1 or 2 "
                           f"(fix the record, or set data.sources[].ties=drop to leave out records that prefer "
                           f"neither, counted)")
    responses = [_text(record, where, "response1"), _text(record, where, "response2")]
    return _pair(where, responses[choice - 1], responses[2 - choice], instruction=_text(record, where, "prompt"),
                 input="")


@fmt("rated", True, "{instruction or prompt, completions: [{response, overall_score or score}, ...]} "
     "(UltraFeedback: the best against the worst)", lambda r: "completions" in r)
def rated(record: dict, where: str) -> dict:
    """Binarised as the best against the worst: chosen is the first completion with the highest score, rejected
    the last with the lowest; margin 0 (scores of different raters are not on one scale)."""
    _need(record, where, "rated", "completions")
    if "instruction" not in record:
        _need(record, where, "rated", "prompt")
    rated_ = record["completions"]
    if not isinstance(rated_, list) or len(rated_) < 2 or not all(
            isinstance(c, dict) and isinstance(c.get("response"), str) for c in rated_):
        raise DataError(f"{where}: 'completions' must be a list of at least two {{response: str, overall_score}}")
    scores = [c.get("overall_score", c.get("score")) for c in rated_]
    bad = next((s for s in scores if isinstance(s, bool) or not isinstance(s, (int, float))), False)
    if bad is not False:
        raise DataError(f"{where}: a completion's score is {bad!r}; each needs a number as overall_score or score")
    best = max(range(len(scores)), key=lambda i: (scores[i], -i))
    worst = min(range(len(scores)), key=lambda i: (scores[i], -i))
    if scores[best] == scores[worst]:
        raise NoPreference(f"{where}: every completion has the score {scores[best]!r}, so none is better (set "
                           f"data.sources[].ties=drop to leave out such records, counted)")
    return _pair(where, rated_[best]["response"], rated_[worst]["response"], **_prompt(record, where))


def _hh_turns(transcript: str, where: str, key: str) -> List[dict]:
    """'\\n\\nHuman: ...\\n\\nAssistant: ...' -> messages (each turn's text stripped, as TRL's hh-rlhf script does)."""
    turns = []
    marks = sorted((i, m) for m in HH_TURN for i in _find_all(transcript, m))
    if not marks or marks[0][0] != 0:
        raise DataError(f"{where}: '{key}' does not start with '\\n\\nHuman:'; an Anthropic HH transcript is "
                        f"'\\n\\nHuman: ...\\n\\nAssistant: ...' turns")
    for k, (at, mark) in enumerate(marks):
        end = marks[k + 1][0] if k + 1 < len(marks) else len(transcript)
        turns.append({"role": HH_TURN[mark], "content": transcript[at + len(mark):end].strip()})
    if turns[-1]["role"] != "assistant":
        raise DataError(f"{where}: '{key}' ends with a Human turn; it must end with the Assistant's response")
    return turns


def _find_all(text: str, mark: str) -> List[int]:
    found, at = [], text.find(mark)
    while at >= 0:
        found.append(at)
        at = text.find(mark, at + len(mark))
    return found


@fmt("hh", True, "{chosen, rejected} as '\\n\\nHuman: ...\\n\\nAssistant: ...' transcripts (Anthropic HH)", _hh_like)
def hh(record: dict, where: str) -> dict:
    """Both transcripts share every turn but the last Assistant's: that is the prompt, as chat turns."""
    _need(record, where, "hh", "chosen", "rejected")
    chosen = _hh_turns(_text(record, where, "chosen"), where, "chosen")
    rejected = _hh_turns(_text(record, where, "rejected"), where, "rejected")
    if chosen[:-1] != rejected[:-1]:
        raise DataError(f"{where}: chosen and rejected differ before their last Assistant turn; an HH pair shares "
                        f"its conversation and differs in the last response only")
    return _pair(where, chosen, rejected)


FORMATS.add(AUTO, Format(AUTO, None, "any format above, detected from the first record's keys", lambda r: False, None))
