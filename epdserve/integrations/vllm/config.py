"""What the operator tells epdserve's vLLM connector: the ``ec_connector_extra_config`` object of
``--ec-transfer-config``, validated into a frozen config (vLLM- and torch-free).

Unknown keys are refused at start-up: a misspelt option silently left at its default would, for
``local_encode``, change what a failed handle does to a request.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from epdserve.common.store_config import StoreConfig
from epdserve.security.credentials import CLUSTER_SECRET_ENV, ClusterCredential
from epdserve.transfer.config import ECConfig


@dataclass(frozen=True)
class VllmECConfig:
    model_id: str = ""  # the model identity handles must carry ("" = vLLM's served model name)
    cluster_secret_file: str = ""  # file holding the cluster secret ("" = the EPD_CLUSTER_SECRET variable)
    local_encode: bool = True  # an item without a usable handle is encoded by vLLM (False: its request fails)
    timeout_s: float = 30.0  # one fetch gives up after this many seconds (then as for a bad handle)
    shm_dir: str = "/dev/shm"  # where producers' slabs live; no slab outside it is mapped
    store_url: str = ""  # the shared embedding store store handles are read from ("" = none)

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        StoreConfig(url=self.store_url)  # raises on a malformed url

    @classmethod
    def from_extra(cls, extra: Mapping[str, object] | None) -> VllmECConfig:
        """The config from ``ec_connector_extra_config``; ValueError naming a bad or unknown key."""
        extra = dict(extra or {})
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(extra) - set(fields))
        if unknown:
            raise ValueError(
                f"unknown ec_connector_extra_config key(s) {', '.join(unknown)} for epdserve's connector "
                f"(known: {', '.join(fields)})"
            )
        values: dict[str, object] = {}
        for name, value in extra.items():
            kind = type(fields[name].default)
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if type(value) is not kind:
                raise ValueError(f"ec_connector_extra_config {name} must be a {kind.__name__}, got {value!r}")
            values[name] = value
        return cls(**values)  # type: ignore[arg-type]

    def credential(self) -> ClusterCredential:
        """The cluster credential; ValueError when there is none (no handle could ever verify)."""
        cred = ClusterCredential.load(self.cluster_secret_file or None)
        if cred is None:
            raise ValueError(
                f"epdserve's connector needs the cluster secret: set {CLUSTER_SECRET_ENV} or "
                "cluster_secret_file in ec_connector_extra_config"
            )
        return cred

    def ec_config(self) -> ECConfig:
        """The consumer-side connector config (its secret read now)."""
        secret = self.credential().secret.decode()
        return ECConfig(
            secret=secret, timeout_s=self.timeout_s, shm_dir=self.shm_dir, store=StoreConfig(url=self.store_url)
        )
