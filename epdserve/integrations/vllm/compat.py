"""Which vLLM EC connector interface epdserve's connector is written against, and the check that
a running vLLM still has it (vLLM-free: it inspects the objects it is given).

The check runs when vLLM imports the connector, i.e. while ``vllm serve`` starts, so a vLLM
upgrade that changed the interface stops the instance at start-up with a message naming both
versions, never mid-request.
"""

from __future__ import annotations

import inspect

TESTED_VLLM = ("0.32",)  # release series the connector was written and tested against
# base-class method -> the parameter names (after self) the connector relies on
INTERFACE: dict[str, tuple[str, ...]] = {
    "start_load_caches": ("encoder_cache", "kwargs"),
    "save_caches": ("encoder_cache", "mm_hash", "kwargs"),
    "has_cache_item": ("identifier",),
    "ensure_cache_available": ("request", "num_computed_tokens"),
    "update_state_after_alloc": ("request", "index"),
    "build_connector_meta": ("scheduler_output",),
    "take_unavailable_requests": (),
    "request_finished": ("request",),
    "bind_connector_metadata": ("connector_metadata",),
    "shutdown": (),
}
REQUEST_ATTRIBUTES = ("request_id", "mm_features", "ec_transfer_params")


class IncompatibleVllm(RuntimeError):
    """The installed vLLM's EC connector interface is not the one this connector implements."""


def interface_problems(base: type, request_cls: type) -> list[str]:
    """What differs between ``base`` (vLLM's ECConnectorBase) and ``request_cls`` (its Request)
    and what the connector relies on; empty when nothing does."""
    problems = []
    for name, params in INTERFACE.items():
        method = getattr(base, name, None)
        if method is None:
            problems.append(f"ECConnectorBase.{name} is gone")
            continue
        got = tuple(p for p in inspect.signature(method).parameters if p != "self")
        if got != params:
            problems.append(f"ECConnectorBase.{name}{got} is not {name}{params}")
    if not callable(getattr(request_cls, "get_num_encoder_embeds", None)):
        problems.append("Request.get_num_encoder_embeds is gone")
    try:  # instance attributes: set in the class's source as self.<name>
        source = inspect.getsource(request_cls)
    except (OSError, TypeError):
        source = ""
    problems += [f"Request.{name} is gone" for name in REQUEST_ATTRIBUTES if f"self.{name}" not in source]
    return problems


def check(version: str, base: type, request_cls: type) -> bool:
    """IncompatibleVllm naming ``version`` when the interface differs; True when ``version`` is of
    a tested series, False for an untested one whose interface still matches."""
    problems = interface_problems(base, request_cls)
    if problems:
        raise IncompatibleVllm(
            f"epdserve's EC connector is written for vLLM {', '.join(TESTED_VLLM)}.x, but vLLM {version} "
            f"has another EC connector interface ({'; '.join(problems)}): install a supported vLLM "
            "or an epdserve release that supports this one"
        )
    return any(version == t or version.startswith(t + ".") for t in TESTED_VLLM)
