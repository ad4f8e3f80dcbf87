"""Chat messages in the shape the chat template expects (one placeholder part per media item)."""

from __future__ import annotations

from epdserve.api.protocol import AssistantMessage, ChatRequest, SystemMessage, TextPart, part_modality


def template_messages(req: ChatRequest) -> list[dict]:
    """Messages in the shape the chat template expects (one placeholder part per media item)."""
    out: list[dict] = []
    for m in req.messages:
        if isinstance(m, SystemMessage | AssistantMessage):
            content = m.content or ""
            text = content if isinstance(content, str) else "".join(p.text for p in content)
            out.append({"role": m.role, "content": text})
            continue
        if isinstance(m.content, str):
            out.append({"role": "user", "content": m.content})
            continue
        parts: list[dict] = []
        for p in m.content:
            if isinstance(p, TextPart):
                parts.append({"type": "text", "text": p.text})
            else:
                parts.append({"type": part_modality(p)})
        out.append({"role": "user", "content": parts})
    return out
