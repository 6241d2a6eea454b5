//! Endpoints: a rank of the source (training) or the destination
//! (inference) group, the two ends of every transfer and message.

use crate::layout::Rank;
use std::fmt;

/// Which group a rank belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
pub enum Group {
    /// The source group: the training ranks.
    Src,
    /// The destination group: the inference ranks.
    Dst,
}

impl std::fmt::Display for Group {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Group::Src => "src",
            Group::Dst => "dst",
        })
    }
}

/// A rank of one group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
pub struct Endpoint {
    /// Its group.
    pub group: Group,
    /// Its rank within the group.
    pub rank: Rank,
}

impl Endpoint {
    /// A source rank.
    pub const fn src(rank: Rank) -> Endpoint {
        Endpoint { group: Group::Src, rank }
    }

    /// A destination rank.
    pub const fn dst(rank: Rank) -> Endpoint {
        Endpoint { group: Group::Dst, rank }
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.group {
            Group::Src => write!(f, "src rank {}", self.rank),
            Group::Dst => write!(f, "dst rank {}", self.rank),
        }
    }
}
