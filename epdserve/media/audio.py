"""Client audio → the log-mel features of a Whisper-style encoder, without torch.

Three steps, each under the limits of ``MediaLimits``:

* ``decode_audio``: WAV, FLAC or MP3 bytes (libsndfile through ``soundfile``) → mono float32 at the
  file's rate. The header is read first, so an audio that claims to be too long or has a rate
  outside the limits is refused before its samples are decoded; the decoder never reads past
  the limit either, whatever the header said.
* ``resample``: to the processor's rate (16 kHz) with a polyphase windowed-sinc filter, the same
  filter as ``scipy.signal.resample_poly``; 16 kHz input is left untouched, as transformers does.
* ``AudioProcessor.features``: the log-mel spectrogram of ``WhisperFeatureExtractor`` (n_fft 400,
  hop 160, Slaney mel filters, log10 clamped at 1e-10, floored 8 below the window's maximum,
  (x + 4) / 4), computed as if the audio were padded with silence to the 30 s window, for the
  valid frames and the few padded ones the encoder reads after them.
"""

from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from epdserve.media.budget import DecodeBudget, guarded
from epdserve.media.errors import InvalidMedia, MediaTooLarge
from epdserve.media.limits import MediaLimits

# the container formats a client may declare, and the libsndfile format names each may turn out to be
AUDIO_FORMATS: dict[str, frozenset[str]] = {
    "wav": frozenset({"WAV", "WAVEX", "RF64", "W64"}),
    "flac": frozenset({"FLAC"}),
    "mp3": frozenset({"MP3", "MPEG"}),
}

# media types of audio data: URLs (the router hands an input_audio part to an encoder as one)
_MIME_FORMATS = {
    "audio/wav": "wav",
    "audio/x-wav": "wav",
    "audio/wave": "wav",
    "audio/flac": "flac",
    "audio/x-flac": "flac",
    "audio/mpeg": "mp3",
    "audio/mp3": "mp3",
}
_FORMAT_MIMES = {"wav": "audio/wav", "flac": "audio/flac", "mp3": "audio/mpeg"}


def audio_data_url(data_b64: str, declared_format: str) -> str:
    """An ``input_audio`` part as a data: URL (its format as the media type)."""
    return f"data:{_FORMAT_MIMES.get(declared_format, 'application/octet-stream')};base64,{data_b64}"


def audio_format_of(url: str) -> str:
    """The declared format of an audio data: URL ("" when it names none of the supported ones)."""
    if url[:5].lower() != "data:":
        return ""
    mime = url[5:].split(",", 1)[0].split(";", 1)[0].strip().lower()
    return _MIME_FORMATS.get(mime, "")


@dataclass(frozen=True)
class AudioProcessorConfig:
    """The feature extractor of an audio model (``preprocessor_config.json``)."""

    sampling_rate: int = 16000  # rate the features are computed at, in Hz
    num_mel_bins: int = 128  # mel filters (the encoder's input channels; "feature_size")
    n_fft: int = 400  # samples per STFT window (25 ms)
    hop_length: int = 160  # samples between frames (10 ms)
    chunk_length: int = 30  # seconds of the encoder's window; shorter audio is padded with silence

    def __post_init__(self) -> None:
        for name in ("sampling_rate", "num_mel_bins", "n_fft", "hop_length", "chunk_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"AudioProcessorConfig.{name} must be positive, got {getattr(self, name)}")

    @property
    def window_samples(self) -> int:
        return self.chunk_length * self.sampling_rate

    @property
    def max_frames(self) -> int:
        """Log-mel frames of the whole window (3000 for 30 s at hop 160)."""
        return self.window_samples // self.hop_length

    def frames(self, num_samples: int) -> int:
        """Valid frames of ``num_samples`` samples: those starting inside the audio, as
        transformers' feature_attention_mask counts them."""
        return -(-num_samples // self.hop_length)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> AudioProcessorConfig:
        path = Path(model_dir) / "preprocessor_config.json"
        d = json.loads(path.read_text()) if path.is_file() else {}
        return cls(
            sampling_rate=int(d.get("sampling_rate", cls.sampling_rate)),
            num_mel_bins=int(d.get("feature_size", cls.num_mel_bins)),
            n_fft=int(d.get("n_fft", cls.n_fft)),
            hop_length=int(d.get("hop_length", cls.hop_length)),
            chunk_length=int(d.get("chunk_length", cls.chunk_length)),
        )


@dataclass(frozen=True)
class AudioFeatures:
    """One audio item ready for the encoder."""

    features: np.ndarray  # float32 [frames carried, num_mel_bins]: valid frames, then the padded ones read
    frames: int  # valid log-mel frames (10 ms each)

    @property
    def grid_thw(self) -> tuple[int, int, int]:
        """The item's extent in its encoder's units, as every media item carries one (see
        ``models.qwen2_audio_layout``)."""
        return (1, self.frames, 1)


# ---- decoding -----------------------------------------------------------------------------------


def decode_audio(
    data: bytes, declared_format: str, limits: MediaLimits, budget: DecodeBudget | None = None
) -> tuple[np.ndarray, int]:
    """Mono float32 samples in [-1, 1] and their rate, from WAV, FLAC or MP3 bytes.

    InvalidMedia for an undeclared or mismatched format, undecodable or empty audio, or a rate
    outside the limits; MediaTooLarge for audio longer than ``limits.max_audio_seconds``.
    """
    fmt = declared_format.lower()
    accepted = [f for f in limits.audio_formats if f in AUDIO_FORMATS]
    if fmt not in accepted:
        raise InvalidMedia(f"The audio format {declared_format!r} is not accepted; accepted: {', '.join(accepted)}.")
    if not data:
        raise InvalidMedia("The audio is empty.")
    budget = budget or DecodeBudget(limits)
    with guarded("audio"):
        return _decode(data, fmt, limits, budget)


def _decode(data: bytes, fmt: str, limits: MediaLimits, budget: DecodeBudget) -> tuple[np.ndarray, int]:
    import soundfile as sf

    try:
        with sf.SoundFile(io.BytesIO(data)) as f:
            if f.format not in AUDIO_FORMATS[fmt]:
                raise InvalidMedia(f"The audio was declared {fmt} but is {f.format.lower()}.")
            rate, channels = int(f.samplerate), int(f.channels)
            if not limits.min_audio_sample_rate <= rate <= limits.max_audio_sample_rate:
                raise InvalidMedia(
                    f"The audio's sample rate is {rate} Hz; {limits.min_audio_sample_rate} to "
                    f"{limits.max_audio_sample_rate} Hz are accepted."
                )
            if channels < 1:
                raise InvalidMedia("The audio has no channels.")
            max_samples = math.floor(limits.max_audio_seconds * rate)
            _check_duration(f.frames, rate, limits)  # the header's claim, before decoding
            # one sample past the limit tells a too-long audio whose header understated its length;
            # read in blocks, so the decode stops when the item's time is spent
            blocks, left = [], max_samples + 1
            while left > 0:
                budget.check("audio")
                block = f.read(frames=min(left, _READ_BLOCK), dtype="float32", always_2d=True)
                if block.shape[0] == 0:
                    break
                blocks.append(block)
                left -= block.shape[0]
            samples = np.concatenate(blocks) if blocks else np.zeros((0, channels), dtype=np.float32)
    except sf.LibsndfileError as e:
        raise InvalidMedia(f"The audio could not be decoded as {fmt}: {e.error_string.rstrip('.')}.") from None
    except (RuntimeError, ValueError, TypeError) as e:  # soundfile's other failures on malformed input
        raise InvalidMedia(f"The audio could not be decoded as {fmt}: {e}.") from None
    _check_duration(samples.shape[0], rate, limits)
    if samples.shape[0] == 0:
        raise InvalidMedia("The audio holds no samples.")
    mono = samples.mean(axis=1, dtype=np.float32) if samples.shape[1] > 1 else samples[:, 0]
    if not np.isfinite(mono).all():
        raise InvalidMedia("The audio holds samples that are not finite numbers.")
    return np.ascontiguousarray(mono), rate


_READ_BLOCK = 1 << 18  # samples decoded between budget checks


def _check_duration(samples: int, rate: int, limits: MediaLimits) -> None:
    if samples > limits.max_audio_seconds * rate:
        raise MediaTooLarge(
            f"The audio is {samples / rate:.2f} s long; at most {limits.max_audio_seconds:g} s are accepted."
        )


# ---- resampling ---------------------------------------------------------------------------------

_KAISER_BETA = 5.0  # resample_poly's default window
_CHUNK = 1 << 16  # output samples computed per step (bounds the gathered window matrix)


def _lowpass(up: int, down: int) -> tuple[np.ndarray, int]:
    """resample_poly's filter: a Kaiser-windowed sinc with cutoff 1/max(up, down) of Nyquist and
    10 zero crossings each side, unit DC gain, times ``up``; returns it and its half length."""
    rate = max(up, down)
    half = 10 * rate
    n = np.arange(2 * half + 1, dtype=np.float64) - half
    h = np.sinc(n / rate) / rate * np.kaiser(2 * half + 1, _KAISER_BETA)
    return h / h.sum() * up, half


def resample(x: np.ndarray, orig_rate: int, target_rate: int) -> np.ndarray:
    """``x`` (1-D) from ``orig_rate`` to ``target_rate`` Hz: the output of
    ``scipy.signal.resample_poly(x, up, down)`` with up/down the reduced ratio, in float32."""
    g = math.gcd(orig_rate, target_rate)
    up, down = target_rate // g, orig_rate // g
    if up == down:
        return x.astype(np.float32, copy=True)
    h, half = _lowpass(up, down)
    # output m = sum_j x[j] * h[m*down + half - j*up]: with c = m*down + half, the taps of phase
    # c % up meet x[c // up], x[c // up - 1], ...
    taps = -(-h.size // up)
    phases = np.zeros((up, taps))
    for p in range(up):
        row = h[p::up]
        phases[p, : row.size] = row
    n_out = -(-x.size * up // down)
    padded = np.concatenate([np.zeros(taps - 1), x.astype(np.float64), np.zeros(taps)])
    back = np.arange(taps)
    out = np.empty(n_out, dtype=np.float32)
    for start in range(0, n_out, _CHUNK):
        c = np.arange(start, min(start + _CHUNK, n_out), dtype=np.int64) * down + half
        window = padded[(c // up)[:, None] - back + (taps - 1)]
        out[start : start + c.size] = np.einsum("mt,mt->m", window, phases[c % up])
    return out


# ---- features -----------------------------------------------------------------------------------


def _hz_to_mel(f: np.ndarray) -> np.ndarray:
    """Slaney's mel scale: linear below 1 kHz, logarithmic above."""
    mels = 3.0 * f / 200.0
    log = f >= 1000.0
    mels[log] = 15.0 + np.log(f[log] / 1000.0) * (27.0 / np.log(6.4))
    return mels


def _mel_to_hz(m: np.ndarray) -> np.ndarray:
    f = 200.0 * m / 3.0
    log = m >= 15.0
    f[log] = 1000.0 * np.exp(np.log(6.4) / 27.0 * (m[log] - 15.0))
    return f


def mel_filters(config: AudioProcessorConfig) -> np.ndarray:
    """Slaney-normalized triangular filters [n_fft/2 + 1, num_mel_bins] from 0 to 8 kHz, as
    transformers' ``mel_filter_bank`` builds them for Whisper."""
    bins, mels = config.n_fft // 2 + 1, config.num_mel_bins
    edges = _mel_to_hz(np.linspace(_hz_to_mel(np.array([0.0]))[0], _hz_to_mel(np.array([8000.0]))[0], mels + 2))
    fft_freqs = np.linspace(0, config.sampling_rate // 2, bins)
    slopes = edges[None, :] - fft_freqs[:, None]
    widths = np.diff(edges)
    down = -slopes[:, :-2] / widths[:-1]
    up = slopes[:, 2:] / widths[1:]
    filters = np.maximum(0.0, np.minimum(down, up))
    return filters * (2.0 / (edges[2 : mels + 2] - edges[:mels]))[None, :]


class AudioProcessor:
    """16 kHz mono samples → Whisper log-mel features of one item."""

    def __init__(self, config: AudioProcessorConfig) -> None:
        self.config = config
        self.filters = mel_filters(config)
        n = np.arange(config.n_fft)
        self.window = 0.5 - 0.5 * np.cos(2 * np.pi * n / config.n_fft)  # periodic Hann, as torch.hann_window

    def features(self, samples: np.ndarray, context_frames: int = 2) -> AudioFeatures:
        """Log-mel features of ``samples`` (1-D, at the config's rate, at most the window long): the
        valid frames and up to ``context_frames`` after them, which an encoder's convolutions read
        (Qwen2-Audio: ``qwen2_audio_layout.CONV_CONTEXT_FRAMES``).

        Equal to ``WhisperFeatureExtractor(samples, padding="max_length")``'s first rows: the audio
        is padded with silence to the window before the STFT, and every frame past the ones
        computed is silence, at the clamp floor, so the window's maximum is among them.
        """
        c = self.config
        if samples.ndim != 1 or samples.size == 0:
            raise InvalidMedia("The audio holds no samples.")
        if samples.size > c.window_samples:
            raise MediaTooLarge(
                f"The audio is {samples.size / c.sampling_rate:.2f} s long; the encoder's window is {c.chunk_length} s."
            )
        frames = c.frames(samples.size)
        carried = min(frames + context_frames, c.max_frames)
        # the padded window around the frames computed: STFT frames are centred (reflect padding
        # of n_fft/2 at both ends of the whole window), frame i covering [i*hop - n_fft/2, i*hop + n_fft/2)
        half = c.n_fft // 2
        span = (carried - 1) * c.hop_length + c.n_fft
        window = np.zeros(c.window_samples, dtype=np.float64)
        window[: samples.size] = samples
        padded = np.pad(window, half, mode="reflect")[:span]
        strided = np.lib.stride_tricks.sliding_window_view(padded, c.n_fft)[:: c.hop_length][:carried]
        power = np.abs(np.fft.rfft(strided * self.window, axis=1)) ** 2
        log_mel = np.log10(np.maximum(power @ self.filters, 1e-10))
        # frames past those computed are silence: log10(1e-10) = -10, never above this maximum
        log_mel = np.maximum(log_mel, log_mel.max() - 8.0)
        return AudioFeatures(((log_mel + 4.0) / 4.0).astype(np.float32), frames)

    def process(
        self,
        data: bytes,
        declared_format: str,
        limits: MediaLimits,
        context_frames: int = 2,
        budget: DecodeBudget | None = None,
    ) -> AudioFeatures:
        """Encoded audio → features: decode, mix to mono, resample, check it fits, extract."""
        samples, rate = decode_audio(data, declared_format, limits, budget)
        if rate != self.config.sampling_rate:
            samples = resample(samples, rate, self.config.sampling_rate)
        return self.features(samples, context_frames)
