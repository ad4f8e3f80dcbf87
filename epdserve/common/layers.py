"""The layers of epdserve, bottom to top: the one statement of which part may import which.

A unit is a subpackage of ``epdserve`` (``engine``) or a top-level module (``launcher``);
``__init__`` is the root package itself. A module may import modules of its own unit and of any
unit in a lower layer, never one of its own layer or above, so units of one layer stay
independent of each other. Imports inside functions count (they are dependencies all the same);
imports under ``if TYPE_CHECKING:`` do not. ``tests/test_layering.py`` holds the code to this
table and fails on any import cycle; ``docs/architecture.md`` describes it.
"""

from __future__ import annotations

from typing import Final

LAYERS: Final[tuple[tuple[str, ...], ...]] = (
    # leaf wire types and helpers: dtypes, sampling parameters, prefix hashing, the store config, log setup
    ("common", "__init__"),
    # process plumbing, credentials, kernels, the embedding cache, synthetic shapes, topologies
    ("allocator", "assets", "config_flags", "launcher", "security", "kernels", "cache", "shapes", "topology"),
    # media preprocessing, model definitions, role supervision
    ("media", "models", "supervisor"),
    # connectors (embeddings, KV, pixels); memory accounting and the transformers reference, over models and media
    ("transfer", "memory", "hf_reference"),
    # the shared embedding store, over its transports
    ("store",),
    # the engine core, scheduler and model runner
    ("engine",),
    # other engines fed by epdserve's encoders (vLLM's EC connector), over the connectors and the fetcher
    ("integrations",),
    # what every role's HTTP side shares: schemas, errors, auth, tokenizer, logs
    ("api",),
    # the encoder role, whose protocol the router speaks
    ("encoder",),
    # the language-model role and the router: independent of each other
    ("pd", "router"),
    # whether a topology fits the machine: the roles' memory accounts, over both kinds of role
    ("sizing",),
    # deployment, training and evaluation
    ("up", "training", "evaluate"),
    ("bench",),
    ("plan",),
    # the command line: what each command assembles, then the entry point
    ("up_cli", "shapes_cli"),
    ("cli",),
)
