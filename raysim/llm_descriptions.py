"""Optional: generate class descriptions for a new dataset with an OpenAI-compatible chat API, and cache
them as a description file (the format of raysim/assets/descriptions/*.json, SPEC 2.7).

Off by default: nothing in raysim calls it. Use it once, then point FedTSP at the file:

    from raysim.llm_descriptions import generate_descriptions
    generate_descriptions(["cat", "dog"], "my_pets.json", base_url="http://127.0.0.1:8000/v1", model="llama3")
    # then: raysim run method=fedtsp fedtsp.descriptions=my_pets.json ...

The API key (if the server wants one) is read from the environment variable named by `api_key_env`;
classes already in the cache file are not asked again.
"""

from __future__ import annotations

import json
import os
import re
import urllib.request
from pathlib import Path
from typing import Sequence

from raysim.methods.fedtsp_descriptions import KEY, parse_descriptions
from raysim.errors import ConfigError

PROMPT = (
    "Write {k} short, fine-grained visual descriptions of the class '{name}'{context}, each one sentence "
    "saying what it looks like in a photo. Answer with a JSON list of {k} strings and nothing else."
)


def _ask(base_url: str, model: str, content: str, *, api_key: str, timeout: float) -> str:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": content}], "temperature": 0}).encode()
    req = urllib.request.Request(base_url.rstrip("/") + "/chat/completions", data=body, method="POST",
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {api_key}"} if api_key else {})})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        reply = json.loads(r.read().decode())
    try:
        return reply["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        raise ConfigError(f"unexpected chat API reply: {str(reply)[:200]}") from None


def _parse_list(text: str, k: int) -> list[str]:
    m = re.search(r"\[.*\]", text, flags=re.S)
    items: list = []
    if m:
        try:
            items = json.loads(m.group(0))
        except json.JSONDecodeError:
            items = []
    if not items:  # fall back to one description per non-empty line
        items = [re.sub(r"^\s*(?:[-*]|\d+[.)])\s*", "", ln).strip() for ln in text.splitlines()]
    items = [str(s).strip() for s in items if str(s).strip()]
    if len(items) < k:
        raise ConfigError(f"the model returned {len(items)} descriptions, {k} were asked: {text[:200]!r}")
    return items[:k]


def generate_descriptions(
    classnames: Sequence[str],
    cache_path: str | Path,
    *,
    base_url: str,
    model: str,
    k: int = 3,
    dataset_context: str = "",
    api_key_env: str = "OPENAI_API_KEY",
    timeout: float = 60.0,
) -> dict[str, list[str]]:
    """Descriptions of every class (asking the API only for classes not yet in `cache_path`); the cache
    file is rewritten after each class, so an interrupted run loses nothing."""
    path = Path(cache_path).expanduser()
    raw = json.loads(path.read_text()) if path.is_file() else {}
    context = f" (from the dataset {dataset_context})" if dataset_context else ""
    api_key = os.environ.get(api_key_env, "")
    for name in classnames:
        if name in raw:
            continue
        text = _ask(base_url, model, PROMPT.format(k=k, name=name.replace("_", " "), context=context),
                    api_key=api_key, timeout=timeout)
        raw[name] = {KEY: _parse_list(text, k)}
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(raw, indent=1, ensure_ascii=False))
        os.replace(tmp, path)
    return parse_descriptions(raw, source=str(path))
