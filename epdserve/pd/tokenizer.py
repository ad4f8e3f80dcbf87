"""The front end's tokenizer: Hugging Face ``tokenizers`` plus the checkpoint's jinja chat template.

The front end only renders, encodes and decodes; importing transformers for that costs seconds of
startup, so this reads ``tokenizer.json``, ``tokenizer_config.json`` (special tokens, template) and
renders the template the way transformers does (sandboxed jinja, ``trim_blocks``/``lstrip_blocks``,
``raise_exception``, ``tojson``, ``strftime_now``). tests/test_tokenizer.py holds it to
transformers' ``AutoTokenizer`` on the same checkpoint.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from epdserve.models.config import check_model_dir


class TemplateError(ValueError):
    """The chat template refused the messages (its ``raise_exception``) or could not render."""


class FastTokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        d = Path(model_dir)
        check_model_dir(d, tokenizer=True)
        self._tok = Tokenizer.from_file(str(d / "tokenizer.json"))
        cfg_path = d / "tokenizer_config.json"
        self.config: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        self.chat_template = self._template(d)
        specials = [
            t for t in json.loads((d / "tokenizer.json").read_text()).get("added_tokens", []) if t.get("special")
        ]
        self.all_special_ids = sorted({int(t["id"]) for t in specials})
        eos = self.config.get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        self.eos_token = eos
        self.eos_token_id = self._tok.token_to_id(eos) if eos else None

    def _template(self, d: Path) -> str | None:
        t = self.config.get("chat_template")
        if isinstance(t, str):
            return t
        if (d / "chat_template.jinja").exists():
            return (d / "chat_template.jinja").read_text()
        return None

    @cached_property
    def _compiled(self):
        import jinja2
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        if self.chat_template is None:
            raise TemplateError("the checkpoint has no chat template")
        try:
            return env.from_string(self.chat_template)
        except jinja2.TemplateError as e:
            raise TemplateError(f"the chat template does not compile: {e}") from e

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, tokenize: bool = False, **kwargs: Any
    ) -> str:
        """The rendered prompt text (``tokenize`` must be False: encode it with ``encode``)."""
        if tokenize:
            raise ValueError("FastTokenizer.apply_chat_template renders text only")
        import jinja2

        specials = {
            k: (v.get("content") if isinstance(v, dict) else v)
            for k, v in self.config.items()
            if k.endswith("_token") and isinstance(v, str | dict)
        }
        try:
            return str(
                self._compiled.render(
                    messages=messages, add_generation_prompt=add_generation_prompt, **specials, **kwargs
                )
            )
        except TemplateError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError) as e:
            raise TemplateError(f"{type(e).__name__}: {e}") from e

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=skip_special_tokens))

    def convert_ids_to_tokens(self, token_id: int) -> str:
        return str(self._tok.id_to_token(token_id))
