"""A calibration's samples on disk, so that a profile can be fitted again without measuring again.

Calibrating a 2B model takes most of an hour; the fit takes a second. ``epdserve plan
--save-samples FILE`` keeps every timed request of the calibration (those measured on the roles'
own cores and those measured lending), and ``--samples FILE`` fits a profile from them with the
fit of the epdserve reading them. The file is versioned JSON; one of another version, or with a
field missing or of the wrong type, is refused with ``ProfileError`` rather than half read.
"""

from __future__ import annotations

import math
from pathlib import Path

import msgspec

from epdserve.plan.profile import ProfileError, Sample

RECORD_VERSION = 1


class SampleRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a calibration measured and where."""

    source: str  # what was calibrated, when, and how loaded the machine was
    nproc: int  # CPUs of the machine
    cpu_model: str
    native_pixels: float  # mean pixels of the generator's own images
    own: list[Sample]  # requests to roles on their own cores (every deployment)
    lent: list[Sample] = []  # the same runs with idle roles lending their cores (split ones)
    version: int = RECORD_VERSION


def save_samples(record: SampleRecord, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(msgspec.json.format(msgspec.json.encode(record), indent=1) + b"\n")
    return path


def load_samples(path: Path) -> SampleRecord:
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ProfileError(f"{path}: cannot read ({e.strerror})") from None
    try:
        data = msgspec.json.decode(raw, type=dict)
    except msgspec.DecodeError as e:
        raise ProfileError(f"{path}: not a JSON object ({e})") from None
    if data.get("version") != RECORD_VERSION:
        raise ProfileError(
            f"{path}: samples of version {data.get('version')!r}, this epdserve reads version {RECORD_VERSION}"
        )
    try:
        record = msgspec.convert(data, type=SampleRecord)
    except msgspec.ValidationError as e:
        raise ProfileError(f"{path}: not a record of calibration samples ({e})") from None
    if not record.own:
        raise ProfileError(f"{path}: no samples")
    for s in (*record.own, *record.lent):
        numbers = [s.images, s.pixels, s.padding, s.prompt_tokens, s.output_tokens, s.concurrency]
        numbers += [s.ttft_s, s.tpot_s, s.decode_batch, *s.stages.values()]
        if not all(math.isfinite(v) and v >= 0 for v in numbers) or s.concurrency < 1:
            raise ProfileError(f"{path}: a sample with a negative or non-finite value: {s}")
    return record
