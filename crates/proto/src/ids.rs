use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// 128-bit random handoff id. It is a capability: whoever knows it may heartbeat, pull or release
/// the handoff, so it must come from a CSPRNG and is never derived from a request id.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HandoffId(u128);

impl HandoffId {
    /// Builds an id from 16 random bytes (the caller provides the randomness: this crate does no
    /// I/O). There is no other constructor but parsing: no id is made up from a number.
    pub fn from_bytes(bytes: [u8; 16]) -> Self {
        HandoffId(u128::from_le_bytes(bytes))
    }

    /// The id's 16 bytes, as [`HandoffId::from_bytes`] took them.
    pub fn to_bytes(self) -> [u8; 16] {
        self.0.to_le_bytes()
    }
}

impl fmt::Display for HandoffId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

impl fmt::Debug for HandoffId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "H{:x}", self.0)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("handoff id must be 32 hexadecimal digits, got {0:?}")]
pub struct ParseHandoffIdError(pub String);

impl FromStr for HandoffId {
    type Err = ParseHandoffIdError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.len() != 32 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(ParseHandoffIdError(s.chars().take(64).collect()));
        }
        u128::from_str_radix(s, 16)
            .map(HandoffId)
            .map_err(|_| ParseHandoffIdError(s.to_string()))
    }
}

// On the binary wire an id is 16 fixed bytes (a varint would cost 19 for random ids); in JSON it
// is 32 hex digits.
impl Serialize for HandoffId {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if s.is_human_readable() {
            s.collect_str(self)
        } else {
            self.0.to_le_bytes().serialize(s)
        }
    }
}

impl<'de> Deserialize<'de> for HandoffId {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        if d.is_human_readable() {
            let s = String::deserialize(d)?;
            s.parse().map_err(serde::de::Error::custom)
        } else {
            <[u8; 16]>::deserialize(d).map(HandoffId::from_bytes)
        }
    }
}

/// Bumped when a handoff's blocks change hands: D retries a failed read under the next epoch and
/// P adopts it from D's heartbeat, so nothing the first attempt left on its way (a completion
/// riding a READ, a grant) counts for the retry. A message carrying another epoch than the
/// current one is ignored and counted (`stale_epoch`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Epoch(pub u32);

impl Epoch {
    pub const FIRST: Epoch = Epoch(1);
    pub fn next(self) -> Epoch {
        Epoch(self.0.wrapping_add(1))
    }
}

impl fmt::Display for Epoch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}
