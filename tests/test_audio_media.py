"""Audio preprocessing: decoding under limits, resampling, and log-mel features equal to
transformers' WhisperFeatureExtractor."""

from __future__ import annotations

import io

import numpy as np
import pytest
import soundfile as sf

from epdserve.media.audio import AudioProcessor, AudioProcessorConfig, decode_audio, mel_filters, resample
from epdserve.media.errors import InvalidMedia, MediaTooLarge
from epdserve.media.limits import MediaLimits
from tests.numerics import assert_close_rel

SR = 16000
LIMITS = MediaLimits()


def noise(n: int, seed: int = 0, channels: int = 1) -> np.ndarray:
    x = 0.3 * np.random.default_rng(seed).standard_normal((n, channels))
    return x.astype(np.float32) if channels > 1 else x[:, 0].astype(np.float32)


def encode(samples: np.ndarray, rate: int, fmt: str, subtype: str | None = None) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, samples, rate, format=fmt, subtype=subtype)
    return buf.getvalue()


@pytest.fixture(scope="module")
def whisper():
    from transformers import WhisperFeatureExtractor

    return WhisperFeatureExtractor(feature_size=128, sampling_rate=SR, hop_length=160, chunk_length=30, n_fft=400)


def whisper_features(whisper, samples: np.ndarray) -> tuple[np.ndarray, int]:
    """transformers' features of one item (padded to 30 s) as [frames, mels], and its valid frames."""
    out = whisper([samples], sampling_rate=SR, return_attention_mask=True, padding="max_length")
    return out["input_features"][0].T, int(out["attention_mask"][0].sum())


# ---- features -----------------------------------------------------------------------------------


def test_mel_filters_are_transformers(whisper) -> None:
    assert_close_rel(mel_filters(AudioProcessorConfig()), whisper.mel_filters, rel=1e-12)


# samples: the fewest that make an embedding, odd and even frame counts, one short of the window
# (its last frames reach the window's end), the whole window
@pytest.mark.parametrize("n", [321, 20800, 11357, 479520, 479999, 480000])
def test_features_equal_whisper_feature_extractor(whisper, n: int) -> None:
    samples = noise(n, seed=n)
    ours = AudioProcessor(AudioProcessorConfig()).features(samples)
    ref, frames = whisper_features(whisper, samples)
    assert ours.frames == frames and ours.grid_thw == (1, frames, 1)
    assert ours.features.shape == (min(frames + 2, 3000), 128) and ours.features.dtype == np.float32
    assert_close_rel(ours.features, ref[: ours.features.shape[0]])


def test_quiet_tail_is_floored_by_the_loud_part(whisper) -> None:
    """The floor (max - 8) comes from the whole window: a loud start sets it for a silent end."""
    samples = np.concatenate([noise(8000), np.zeros(8000, np.float32), 1e-6 * noise(8000, 1)])
    ours = AudioProcessor(AudioProcessorConfig()).features(samples)
    ref, _ = whisper_features(whisper, samples)
    assert_close_rel(ours.features, ref[: ours.features.shape[0]])
    assert np.isclose(ours.features.min(), ours.features.max() - 2.0)  # (max - 8 + 4) / 4 = max' - 2


def test_features_refuse_audio_longer_than_the_window() -> None:
    with pytest.raises(MediaTooLarge):
        AudioProcessor(AudioProcessorConfig()).features(noise(480001))


def test_config_from_preprocessor_config(tmp_path) -> None:
    (tmp_path / "preprocessor_config.json").write_text(
        '{"feature_size": 80, "sampling_rate": 16000, "chunk_length": 30}'
    )
    cfg = AudioProcessorConfig.from_pretrained(tmp_path)
    assert cfg.num_mel_bins == 80 and cfg.max_frames == 3000 and cfg.frames(321) == 3


# ---- resampling ---------------------------------------------------------------------------------


@pytest.mark.parametrize("rate", [44100, 48000, 22050, 8000, 11025])
def test_resample_equals_scipy_resample_poly(rate: int) -> None:
    signal = pytest.importorskip("scipy.signal")
    x = noise(rate, seed=rate)
    g = np.gcd(rate, SR)
    assert_close_rel(resample(x, rate, SR), signal.resample_poly(x.astype(np.float64), SR // g, rate // g), rel=1e-5)


def test_resample_keeps_16k_untouched() -> None:
    x = noise(1000)
    assert np.array_equal(resample(x, SR, SR), x)


def test_resampled_tone_keeps_its_frequency() -> None:
    t = np.arange(44100) / 44100
    y = resample(np.sin(2 * np.pi * 440 * t).astype(np.float32), 44100, SR)
    assert y.size == SR
    assert abs(np.argmax(np.abs(np.fft.rfft(y))) - 440) <= 1  # 1 Hz bins over one second


# ---- decoding -----------------------------------------------------------------------------------


def test_wav_16k_decodes_to_the_samples_transformers_would_get() -> None:
    x = noise(16000)
    data = encode(x, SR, "WAV", "FLOAT")
    samples, rate = decode_audio(data, "wav", LIMITS)
    assert rate == SR and np.array_equal(samples, x)


@pytest.mark.parametrize(("fmt", "tolerance"), [("WAV", 1e-4), ("FLAC", 1e-4), ("MP3", 0.2)])
def test_stereo_decodes_to_the_channel_mean(fmt: str, tolerance: float) -> None:
    t = np.arange(22050) / 22050
    left, right = np.sin(2 * np.pi * 300 * t), 0.5 * np.sin(2 * np.pi * 300 * t)
    data = encode(np.stack([left, right], axis=1).astype(np.float32) * 0.5, 22050, fmt)
    samples, rate = decode_audio(data, fmt.lower(), LIMITS)
    assert rate == 22050 and samples.ndim == 1 and samples.dtype == np.float32
    assert abs(samples.size - t.size) < 2000  # mp3 adds encoder delay and padding
    assert np.abs(samples).max() == pytest.approx(0.375, abs=tolerance)  # (1 + 0.5) / 2 * 0.5


def test_process_resamples_then_extracts(whisper) -> None:
    signal = pytest.importorskip("scipy.signal")
    x = noise(44100 * 2, seed=3)
    feats = AudioProcessor(AudioProcessorConfig()).process(encode(x, 44100, "FLAC", "PCM_24"), "flac", LIMITS)
    decoded, _ = sf.read(io.BytesIO(encode(x, 44100, "FLAC", "PCM_24")), dtype="float32")
    ref, frames = whisper_features(
        whisper, signal.resample_poly(decoded.astype(np.float64), 160, 441).astype(np.float32)
    )
    assert feats.frames == frames == 200
    assert_close_rel(feats.features, ref[: feats.features.shape[0]])


@pytest.mark.parametrize(
    ("data", "fmt", "error", "words"),
    [
        (b"", "wav", InvalidMedia, "empty"),
        (b"RIFF" + b"\x00" * 60, "wav", InvalidMedia, "could not be decoded"),
        (b"not audio at all" * 10, "mp3", InvalidMedia, "could not be decoded"),
        (encode(noise(1600), SR, "FLAC"), "wav", InvalidMedia, "declared wav but is flac"),
        (encode(noise(1600), SR, "WAV"), "ogg", InvalidMedia, "audio format .ogg. is not accepted"),
        (encode(noise(16000 * 31), SR, "FLAC"), "flac", MediaTooLarge, "at most 30 s"),
        (encode(noise(1000), 4000, "WAV"), "wav", InvalidMedia, "sample rate is 4000 Hz"),
        (encode(np.zeros((0, 1), np.float32), SR, "WAV"), "wav", InvalidMedia, "no samples"),
        (encode(np.array([0.1, np.nan, 0.2], np.float32), SR, "WAV", "FLOAT"), "wav", InvalidMedia, "not finite"),
    ],
    ids=[
        "empty",
        "truncated-header",
        "garbage",
        "mismatched",
        "unsupported",
        "too-long",
        "low-rate",
        "no-samples",
        "nan",
    ],
)
def test_bad_audio_is_refused_with_a_clear_error(data: bytes, fmt: str, error: type, words: str) -> None:
    with pytest.raises(error, match=words):
        decode_audio(data, fmt, LIMITS)


def test_duration_limit_is_configurable() -> None:
    data = encode(noise(16000 * 3), SR, "WAV")
    with pytest.raises(MediaTooLarge, match="at most 2 s"):
        decode_audio(data, "wav", MediaLimits(max_audio_seconds=2))
    assert decode_audio(data, "WAV", MediaLimits(max_audio_seconds=3))[0].size == 48000


def test_limits_validate_audio_fields() -> None:
    with pytest.raises(ValueError):
        MediaLimits(max_audio_seconds=0)
    with pytest.raises(ValueError):
        MediaLimits(min_audio_sample_rate=48000, max_audio_sample_rate=16000)
    assert MediaLimits(max_audios_per_prompt=3).max_items("audio") == 3
