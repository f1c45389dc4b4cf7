"""Number formats and the MAC/accumulate contract shared by every target (``docs/numerics.md``)."""

from nhil.numerics.bf16 import bf16_bits_to_f32, f32_to_bf16_bits, round_to_bf16
from nhil.numerics.mac import CANONICAL_NAN_F32, burst_dot16, mac_bursts

__all__ = [
    "bf16_bits_to_f32",
    "f32_to_bf16_bits",
    "round_to_bf16",
    "burst_dot16",
    "mac_bursts",
    "CANONICAL_NAN_F32",
]
