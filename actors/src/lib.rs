//! Actor runtime (in progress).
