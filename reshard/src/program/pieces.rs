//! Packed pieces: [`Pieces`], the pieces of one message or a round's local
//! copies packed into words, read back whole ([`Pieces::iter`]) or in place
//! through views ([`SendPieceView`], [`RecvPieceView`], [`LocalCopyView`]).

mod packed;

pub(super) use packed::Pack;
pub use packed::Spans;

use super::{LocalCopy, RecvPiece, SendPiece, Span};
use crate::block::Block;
use crate::dtype::DType;
use packed::{Packed, Raw};
use serde::de::{SeqAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;
use std::marker::PhantomData;

/// The pieces of one message, or a round's local copies: a list of `P`
/// (a [`SendPiece`], [`RecvPiece`] or [`LocalCopy`]) packed into words,
/// read back piece by piece. A rank's program holds tens of thousands of
/// pieces, almost all of 1 to 3 dimensions, which `Vec<P>` would store at
/// [`MAX_DIMS`](crate::block::MAX_DIMS) dimensions each (over 200 bytes, plus a heap list of spans
/// for a received piece or a local copy); packed, a 2-D piece with one span
/// takes 9 words (72 bytes).
///
/// # Encoding
/// Pieces lie back to back in one `Vec<u64>`, each as:
///
/// | words | content |
/// |---|---|
/// | 1 | header: bits 0-3 the block's `ndim` (0 to [`MAX_DIMS`](crate::block::MAX_DIMS)); bits 4-7 and 8-11 two dtypes (as [`DType::index`]); bit 12 set when some span has a non-zero stride past `ndim` (every span of the piece then stores all [`MAX_DIMS`](crate::block::MAX_DIMS) strides, so nothing is lost); bits 16-63 the number of spans |
/// | `ndim` | the block's offsets |
/// | `ndim` | the block's extents |
/// | `2 + s` per span | the span's buffer, its base, then its first `s` strides (`s` is `ndim`, or [`MAX_DIMS`](crate::block::MAX_DIMS) with bit 12) |
///
/// | piece | dtypes | spans |
/// |---|---|---|
/// | [`SendPiece`] | `wire`, `dtype` | `span` |
/// | [`RecvPiece`] | `wire`, `dtype` | `spans` |
/// | [`LocalCopy`] | `from_dtype`, `to_dtype` | `from`, then `to` |
///
/// [`iter`](Pieces::iter) decodes each piece into a `P`; `views` reads
/// each in place ([`SendPieceView`], [`RecvPieceView`], [`LocalCopyView`]),
/// decoding only the fields asked for: what the executor's per-piece loops
/// use.
///
/// Reading a piece back gives exactly the piece pushed, and a piece has one
/// encoding, so two lists are equal when their words are. Serde reads and
/// writes a plain sequence of `P`, exactly as `Vec<P>` does (a piece read
/// is checked by `P`'s own deserialization, a [`Block`] by its own).
pub struct Pieces<P> {
    words: Vec<u64>,
    len: usize,
    /// Sum over the pieces of element count times the size of the first
    /// dtype (kept as pieces are pushed: a message's bytes on the wire
    /// without a pass over its pieces).
    first_dtype_bytes: u64,
    /// Pieces whose two dtypes differ.
    converting: usize,
    piece: PhantomData<fn() -> P>,
}

/// Words a list takes at its first push (a few pieces' worth).
const FIRST_WORDS: usize = 64;

/// Declares a view of one kind of packed piece: a few words, its fields
/// decoded only when asked for, so the executor's per-piece loops neither
/// allocate nor move whole blocks around. A piece that crosses the wire
/// (sent or received) has its two types read as `wire` and `dtype`.
macro_rules! view {
    ($(#[$doc:meta])* $view:ident of $piece:ident, crossing the wire) => {
        view! { $(#[$doc])* $view of $piece }

        impl $view<'_> {
            /// Type on the wire.
            #[inline]
            pub fn wire(&self) -> DType {
                self.0.header.dtypes[0]
            }

            /// Type of the rank's buffers: the one read (sent) or those
            /// written (received).
            #[inline]
            pub fn dtype(&self) -> DType {
                self.0.header.dtypes[1]
            }
        }
    };
    ($(#[$doc:meta])* $view:ident of $piece:ident) => {
        $(#[$doc])*
        #[derive(Clone, Copy)]
        pub struct $view<'a>(Packed<'a>);

        impl<'a> $view<'a> {
            /// The piece.
            #[inline]
            pub fn block(&self) -> Block {
                self.0.block()
            }

            /// The piece's extent per dimension (no [`Block`] decoded).
            #[inline]
            pub fn extent(&self) -> &'a [u64] {
                self.0.extent()
            }

            /// The piece's number of elements, saturating at `u64::MAX`
            /// (a deserialized piece's extents may multiply past it).
            #[inline]
            pub fn numel(&self) -> u64 {
                self.0.extent().iter().fold(1u64, |n, &e| n.saturating_mul(e))
            }

            /// The piece's number of elements, `None` where its extents
            /// multiply past `u64`.
            #[inline]
            pub fn checked_numel(&self) -> Option<u64> {
                self.0.extent().iter().try_fold(1u64, |n, &e| n.checked_mul(e))
            }

            /// Where the piece's words lie in memory, for a reader that
            /// prefetches what follows them (the pointer is not for
            /// reading: nothing is promised past the piece's own words).
            #[inline]
            pub fn words_ptr(&self) -> *const u64 {
                self.0.words.as_ptr()
            }

            /// The whole piece, decoded.
            pub fn get(&self) -> $piece {
                $piece::unpack(self.0.words)
            }
        }

        impl fmt::Debug for $view<'_> {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Debug::fmt(&self.get(), f)
            }
        }
    };
}

view! {
    /// A [`SendPiece`] read in place from [`Pieces`].
    SendPieceView of SendPiece, crossing the wire
}

view! {
    /// A [`RecvPiece`] read in place from [`Pieces`]: its spans are decoded
    /// as they are iterated, so reading it allocates nothing.
    RecvPieceView of RecvPiece, crossing the wire
}

view! {
    /// A [`LocalCopy`] read in place from [`Pieces`]: the places written are
    /// decoded as they are iterated, so reading it allocates nothing.
    LocalCopyView of LocalCopy
}

impl SendPieceView<'_> {
    /// Where to read it.
    #[inline]
    pub fn span(&self) -> Span {
        self.0.first_span()
    }
}

impl<'a> RecvPieceView<'a> {
    /// Every place on this rank that holds it.
    #[inline]
    pub fn spans(&self) -> Spans<'a> {
        self.0.spans()
    }
}

impl<'a> LocalCopyView<'a> {
    /// Where to read.
    #[inline]
    pub fn from(&self) -> Span {
        self.0.first_span()
    }

    /// Type read.
    #[inline]
    pub fn from_dtype(&self) -> DType {
        self.0.header.dtypes[0]
    }

    /// Where to write.
    #[inline]
    pub fn to(&self) -> Spans<'a> {
        let mut spans = self.0.spans();
        spans.next();
        spans
    }

    /// Type written.
    #[inline]
    pub fn to_dtype(&self) -> DType {
        self.0.header.dtypes[1]
    }
}

impl<P> Pieces<P> {
    /// No pieces.
    pub const fn new() -> Pieces<P> {
        Pieces { words: Vec::new(), len: 0, first_dtype_bytes: 0, converting: 0, piece: PhantomData }
    }

    /// Number of pieces.
    #[inline]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there is no piece.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Number of pieces whose two dtypes differ: sent or received pieces
    /// whose wire type is not their buffer's, local copies that convert.
    pub fn converting(&self) -> usize {
        self.converting
    }

    /// Frees memory reserved for pieces not pushed yet.
    pub fn shrink_to_fit(&mut self) {
        self.words.shrink_to_fit();
    }

    #[inline]
    fn raw(&self) -> Raw<'_> {
        Raw::new(&self.words, self.len)
    }

    /// Sum of element counts times the size of each piece's first dtype
    /// (the wire type of a sent or received piece).
    pub(super) fn first_dtype_bytes(&self) -> u64 {
        self.first_dtype_bytes
    }
}

impl<P: Pack> Pieces<P> {
    /// Appends a piece.
    pub fn push(&mut self, piece: &P) {
        if self.words.capacity() == 0 {
            // Messages mostly hold tens of pieces: fewer growths.
            self.words.reserve(FIRST_WORDS);
        }
        let start = self.words.len();
        piece.pack(&mut self.words);
        let p = Packed::new(&self.words[start..]);
        // Saturating: a hostile deserialized piece must not panic here
        // (the executor refuses pieces that do not fit their buffers).
        let numel = p.extent().iter().fold(1u64, |a, &e| a.saturating_mul(e));
        self.first_dtype_bytes = self.first_dtype_bytes.saturating_add(numel.saturating_mul(p.header.dtypes[0].size()));
        self.converting += usize::from(p.header.dtypes[0] != p.header.dtypes[1]);
        self.len += 1;
    }

    /// The pieces in order, each decoded into a `P` as it is read.
    pub fn iter(&self) -> Iter<'_, P> {
        Iter { raw: self.raw(), piece: PhantomData }
    }
}

impl Pieces<SendPiece> {
    /// The pieces in order, read in place: each field is decoded only when
    /// asked for.
    #[inline]
    pub fn views(&self) -> impl ExactSizeIterator<Item = SendPieceView<'_>> + Clone {
        self.raw().map(|w| SendPieceView(Packed::new(w)))
    }
}

impl Pieces<RecvPiece> {
    /// The pieces in order, read in place: each field is decoded only when
    /// asked for, and no list of spans is allocated.
    #[inline]
    pub fn views(&self) -> impl ExactSizeIterator<Item = RecvPieceView<'_>> + Clone {
        self.raw().map(|w| RecvPieceView(Packed::new(w)))
    }
}

impl Pieces<LocalCopy> {
    /// The copies in order, read in place: each field is decoded only when
    /// asked for, and no list of spans is allocated.
    #[inline]
    pub fn views(&self) -> impl ExactSizeIterator<Item = LocalCopyView<'_>> + Clone {
        self.raw().map(|w| LocalCopyView(Packed::new(w)))
    }
}

/// The pieces of a [`Pieces`], decoded one by one ([`Pieces::iter`]).
pub struct Iter<'a, P> {
    raw: Raw<'a>,
    piece: PhantomData<fn() -> P>,
}

impl<P: Pack> Iterator for Iter<'_, P> {
    type Item = P;

    fn next(&mut self) -> Option<P> {
        self.raw.next().map(P::unpack)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        self.raw.size_hint()
    }
}

impl<P: Pack> ExactSizeIterator for Iter<'_, P> {}

impl<P> Clone for Iter<'_, P> {
    fn clone(&self) -> Self {
        Iter { raw: self.raw.clone(), piece: PhantomData }
    }
}

impl<'a, P: Pack> IntoIterator for &'a Pieces<P> {
    type Item = P;
    type IntoIter = Iter<'a, P>;

    fn into_iter(self) -> Iter<'a, P> {
        self.iter()
    }
}

impl<P> Default for Pieces<P> {
    fn default() -> Self {
        Pieces::new()
    }
}

impl<P> Clone for Pieces<P> {
    fn clone(&self) -> Self {
        Pieces {
            words: self.words.clone(),
            len: self.len,
            first_dtype_bytes: self.first_dtype_bytes,
            converting: self.converting,
            piece: PhantomData,
        }
    }
}

impl<P> PartialEq for Pieces<P> {
    fn eq(&self, other: &Self) -> bool {
        self.len == other.len && self.words == other.words
    }
}

impl<P> Eq for Pieces<P> {}

impl<P: Pack + fmt::Debug> fmt::Debug for Pieces<P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl<P: Pack> Extend<P> for Pieces<P> {
    fn extend<I: IntoIterator<Item = P>>(&mut self, iter: I) {
        for p in iter {
            self.push(&p);
        }
    }
}

impl<P: Pack> FromIterator<P> for Pieces<P> {
    fn from_iter<I: IntoIterator<Item = P>>(iter: I) -> Self {
        let mut out = Pieces::new();
        out.extend(iter);
        out
    }
}

impl<P: Pack + Serialize> Serialize for Pieces<P> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_seq(self.iter())
    }
}

impl<'de, P: Pack + Deserialize<'de>> Deserialize<'de> for Pieces<P> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Seq<P>(PhantomData<fn() -> P>);
        impl<'de, P: Pack + Deserialize<'de>> Visitor<'de> for Seq<P> {
            type Value = Pieces<P>;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a sequence of pieces")
            }

            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Pieces<P>, A::Error> {
                let mut out = Pieces::new();
                while let Some(p) = seq.next_element::<P>()? {
                    out.push(&p);
                }
                out.shrink_to_fit();
                Ok(out)
            }
        }
        deserializer.deserialize_seq(Seq(PhantomData))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block::MAX_DIMS;
    use crate::dtype::ALL_DTYPES;
    use crate::plan::Endpoint;
    use crate::program::Message;

    /// Deterministic pseudo-random numbers (xorshift64*).
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }

        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }

        /// A value up to `max`: small, near `max`, or anywhere.
        fn value(&mut self, max: u64) -> u64 {
            match self.below(4) {
                0 => self.below(16).min(max),
                1 => max - self.below(16).min(max),
                _ => self.next() % max.saturating_add(1).max(1),
            }
        }
    }

    /// Piece number `i`: `i % 9` dimensions, dtypes cycling through all,
    /// values up to `max` (blocks stay within `u64`, as deserialization
    /// demands); one span in eight has non-zero strides past its dimensions.
    struct Gen {
        rng: Rng,
        max: u64,
    }

    impl Gen {
        fn block(&mut self, i: usize) -> Block {
            let nd = i % 9;
            let offset: Vec<u64> = (0..nd).map(|_| self.rng.value(self.max)).collect();
            let extent: Vec<u64> = offset.iter().map(|&o| self.rng.value(self.max - o)).collect();
            Block::new(&offset, &extent)
        }

        fn span(&mut self, nd: usize) -> Span {
            let stray = self.rng.below(8) == 0;
            let mut strides = [0; MAX_DIMS];
            for (d, s) in strides.iter_mut().enumerate() {
                if d < nd || stray {
                    *s = self.rng.value(self.max);
                }
            }
            Span { buffer: self.rng.value(u32::MAX.into()) as u32, base: self.rng.value(self.max), strides }
        }

        fn spans(&mut self, nd: usize, n: usize) -> Vec<Span> {
            (0..n).map(|_| self.span(nd)).collect()
        }

        fn dtypes(i: usize) -> (DType, DType) {
            (ALL_DTYPES[i % ALL_DTYPES.len()], ALL_DTYPES[(i / ALL_DTYPES.len() + 3 * i) % ALL_DTYPES.len()])
        }

        fn send(&mut self, i: usize) -> SendPiece {
            let block = self.block(i);
            let (dtype, wire) = Gen::dtypes(i);
            SendPiece { block, span: self.span(block.ndim()), dtype, wire }
        }

        fn recv(&mut self, i: usize) -> RecvPiece {
            let block = self.block(i);
            let (wire, dtype) = Gen::dtypes(i);
            let n = 1 + self.rng.below(3) as usize;
            RecvPiece { block, spans: self.spans(block.ndim(), n), wire, dtype }
        }

        fn local(&mut self, i: usize) -> LocalCopy {
            let block = self.block(i);
            let (from_dtype, to_dtype) = Gen::dtypes(i);
            let n = self.rng.below(3) as usize;
            LocalCopy { block, from: self.span(block.ndim()), from_dtype, to: self.spans(block.ndim(), n), to_dtype }
        }
    }

    /// `pieces` packed, pushed one by one and read back (also through
    /// `views`, which reads a list in place), equal as lists and as serde
    /// sequences (JSON, both ways) to the `Vec` they came from.
    fn check<P>(pieces: &[P], views: impl Fn(&Pieces<P>) -> Vec<P>)
    where
        P: Pack + Clone + PartialEq + fmt::Debug + Serialize + serde::de::DeserializeOwned,
    {
        let packed: Pieces<P> = pieces.iter().cloned().collect();
        assert_eq!((packed.len(), packed.is_empty()), (pieces.len(), pieces.is_empty()));
        assert_eq!(packed.iter().collect::<Vec<P>>(), pieces);
        assert_eq!(views(&packed), pieces);
        assert_eq!(packed.iter().len(), pieces.len());
        let mut pushed = Pieces::default();
        for p in pieces {
            pushed.push(p);
        }
        assert_eq!(pushed, packed);
        let mut extended = Pieces::new();
        extended.extend(pieces[..pieces.len() / 2].iter().cloned());
        extended.extend(pieces[pieces.len() / 2..].iter().cloned());
        assert_eq!(extended, packed);
        assert_eq!(packed.clone(), packed);
        assert_eq!(format!("{packed:?}"), format!("{pieces:?}"));
        let json = serde_json::to_string(pieces).unwrap();
        assert_eq!(serde_json::to_string(&packed).unwrap(), json);
        let back: Pieces<P> = serde_json::from_str(&json).unwrap();
        assert_eq!(back, packed);
        if let Some((last, rest)) = pieces.split_last() {
            assert_ne!(rest.iter().cloned().collect::<Pieces<P>>(), packed);
            assert_ne!(rest.iter().chain(rest.first()).cloned().collect::<Pieces<P>>(), rest.iter().chain([last]).cloned().collect());
        }
    }

    #[test]
    fn pieces_round_trip() {
        // (seed, pieces, largest value)
        let cases = [(1, 0, u64::MAX), (2, 1, u64::MAX), (3, 9, 100), (4, 90, u64::MAX), (5, 270, u64::MAX), (6, 90, 1 << 40)];
        for (seed, n, max) in cases {
            let mut g = Gen { rng: Rng(seed), max };
            // Each view's fields, and the piece it decodes to whole.
            let sends: Vec<SendPiece> = (0..n).map(|i| g.send(i)).collect();
            check(&sends, |p| {
                p.views()
                    .map(|v| {
                        let piece = SendPiece { block: v.block(), span: v.span(), dtype: v.dtype(), wire: v.wire() };
                        assert_eq!((v.get(), v.extent()), (piece.clone(), piece.block.extent()));
                        piece
                    })
                    .collect()
            });
            let recvs: Vec<RecvPiece> = (0..n).map(|i| g.recv(i)).collect();
            check(&recvs, |p| {
                p.views()
                    .map(|v| {
                        let piece = RecvPiece { block: v.block(), spans: v.spans().collect(), wire: v.wire(), dtype: v.dtype() };
                        assert_eq!((v.get(), v.extent(), v.spans().len()), (piece.clone(), piece.block.extent(), piece.spans.len()));
                        piece
                    })
                    .collect()
            });
            let locals: Vec<LocalCopy> = (0..n).map(|i| g.local(i)).collect();
            check(&locals, |p| {
                p.views()
                    .map(|v| {
                        let piece = LocalCopy {
                            block: v.block(),
                            from: v.from(),
                            from_dtype: v.from_dtype(),
                            to: v.to().collect(),
                            to_dtype: v.to_dtype(),
                        };
                        assert_eq!((v.get(), v.extent(), v.to().len()), (piece.clone(), piece.block.extent(), piece.to.len()));
                        piece
                    })
                    .collect()
            });
            if max <= 100 {
                // Small enough for element counts not to overflow.
                let peer = Endpoint::dst(1);
                let numel: Vec<u64> = sends.iter().map(|p| p.block.numel()).collect();
                let packed: Pieces<SendPiece> = sends.iter().cloned().collect();
                assert_eq!(packed.views().map(|v| v.numel()).collect::<Vec<_>>(), numel);
                let want: u64 = sends.iter().map(|p| p.block.numel() * p.wire.size()).sum();
                assert_eq!(Message { peer, pieces: sends.iter().cloned().collect() }.wire_bytes(), want);
                let want: u64 = recvs.iter().map(|p| p.block.numel() * p.wire.size()).sum();
                assert_eq!(Message { peer, pieces: recvs.iter().cloned().collect() }.wire_bytes(), want);
            }
        }
    }

    #[test]
    fn pieces_take_few_words() {
        let span = |strides: [u64; MAX_DIMS]| Span { buffer: 3, base: 1 << 50, strides };
        let block = Block::new(&[2, 4], &[8, 16]);
        let (f32_, bf16) = (DType::F32, DType::BF16);
        // Row-major strides of a 16-wide buffer, nothing past the block's 2-D.
        let tight = [16, 1, 0, 0, 0, 0, 0, 0];
        let send = |strides| SendPiece { block, span: span(strides), dtype: f32_, wire: bf16 };
        let recv = |n| RecvPiece { block, spans: vec![span(tight); n], wire: bf16, dtype: f32_ };
        let local = LocalCopy { block, from: span(tight), from_dtype: f32_, to: vec![], to_dtype: f32_ };
        // (pieces of each kind, words of each list): a 2-D piece takes a
        // header, two offsets, two extents, then per span a buffer, a base
        // and two strides (all eight when one past the block's is set).
        let cases = [
            (vec![send(tight)], vec![recv(1)], vec![local.clone()], [9; 3]),
            (vec![send([16, 1, 0, 0, 0, 0, 0, 7])], vec![recv(2)], vec![local.clone(), local], [5 + 10, 5 + 2 * 4, 2 * 9]),
            (vec![], vec![], vec![], [0; 3]),
        ];
        for (s, r, l, words) in cases {
            let (s, r, l): (Pieces<_>, Pieces<_>, Pieces<_>) = (s.into_iter().collect(), r.into_iter().collect(), l.into_iter().collect());
            assert_eq!([s.words.len(), r.words.len(), l.words.len()], words, "{s:?} {r:?} {l:?}");
        }
    }

    #[test]
    fn invalid_pieces_are_refused() {
        let span = r#"{"buffer": 0, "base": 0, "strides": [1, 0, 0, 0, 0, 0, 0, 0]}"#;
        let piece = |block: &str| format!(r#"[{{"block": {block}, "span": {span}, "dtype": "F32", "wire": "BF16"}}]"#);
        // (JSON, valid)
        let cases = [
            (piece(r#"{"offset": [1], "extent": [2]}"#), true),
            (piece(r#"{"offset": [1, 0], "extent": [2]}"#), false),
            (piece(r#"{"offset": [0, 0, 0, 0, 0, 0, 0, 0, 0], "extent": [1, 1, 1, 1, 1, 1, 1, 1, 1]}"#), false),
            (piece(r#"{"offset": [18446744073709551615], "extent": [1]}"#), false),
            ("[]".to_string(), true),
            ("{}".to_string(), false),
        ];
        for (json, valid) in cases {
            let packed = serde_json::from_str::<Pieces<SendPiece>>(&json);
            let listed = serde_json::from_str::<Vec<SendPiece>>(&json);
            assert_eq!((packed.is_ok(), listed.is_ok()), (valid, valid), "{json}");
            if let (Ok(p), Ok(l)) = (packed, listed) {
                assert_eq!(p.iter().collect::<Vec<_>>(), l);
            }
        }
    }
}
