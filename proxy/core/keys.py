"""Episode keys and ids: random secrets for agents, stored only as hashes and compared in constant time."""

import hashlib
import hmac
import random
import secrets
import time

KEY_PREFIX = "tpk-"


def new_key() -> str:
    """A fresh episode key with 256 bits of randomness."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def same_secret(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


def new_id(prefix: str) -> str:
    """A unique id that sorts roughly by creation time (millisecond clock, then 48 random bits). Ids are not
    secrets, so they come from the fast generator (seeded from the OS), not from a system call each."""
    return f"{prefix}_{time.time_ns() // 1_000_000:011x}{random.getrandbits(48):012x}"
