//! How pieces pack into words (the encoding of [`Pieces`](super::Pieces))
//! and read back in place: [`Header`], [`Packed`], [`Spans`], [`Raw`].

use crate::block::{Block, MAX_DIMS};
use crate::dtype::{DType, ALL_DTYPES};
use crate::program::{LocalCopy, RecvPiece, SendPiece, Span};
use std::fmt;

/// How one kind of piece packs into the words of [`Pieces`](super::Pieces)
/// (sealed: only the piece types of this module implement it).
mod packing {
    /// Packs a piece into words, and unpacks it (see [`Pieces`](crate::Pieces)).
    pub trait Pack: Sized {
        /// Appends the piece's words to `out`.
        fn pack(&self, out: &mut Vec<u64>);
        /// The piece whose words are exactly `words` (as packed).
        fn unpack(words: &[u64]) -> Self;
    }
}
pub(in crate::program) use packing::Pack;

/// A packed piece's header word (see [`Pieces`](super::Pieces)).
#[derive(Clone, Copy)]
pub(super) struct Header {
    pub(super) ndim: usize,
    pub(super) dtypes: [DType; 2],
    /// Spans store all [`MAX_DIMS`] strides.
    wide: bool,
    spans: usize,
}

impl Header {
    const WIDE: u64 = 1 << 12;
    const SPANS_SHIFT: u32 = 16;

    fn word(self) -> u64 {
        self.ndim as u64
            | u64::from(self.dtypes[0].index()) << 4
            | u64::from(self.dtypes[1].index()) << 8
            | if self.wide { Header::WIDE } else { 0 }
            | (self.spans as u64) << Header::SPANS_SHIFT
    }

    #[inline]
    fn read(w: u64) -> Header {
        // Only `word` writes headers: the codes are those of `DType::index`.
        let dtype = |code: u64| ALL_DTYPES[(code & 0xf) as usize];
        Header {
            ndim: (w & 0xf) as usize,
            dtypes: [dtype(w >> 4), dtype(w >> 8)],
            wide: w & Header::WIDE != 0,
            spans: (w >> Header::SPANS_SHIFT) as usize,
        }
    }

    /// Strides stored per span.
    #[inline]
    fn strides(self) -> usize {
        if self.wide {
            MAX_DIMS
        } else {
            self.ndim
        }
    }

    /// Words of the whole piece, header included.
    #[inline]
    fn words(self) -> usize {
        1 + 2 * self.ndim + self.spans * (2 + self.strides())
    }
}

/// Appends one piece: `spans` holds `n` spans.
fn pack_piece<'s>(out: &mut Vec<u64>, block: &Block, dtypes: [DType; 2], spans: impl Iterator<Item = &'s Span> + Clone, n: usize) {
    let ndim = block.ndim();
    // `spans.len()` of a Vec cannot reach 2^48 (each span takes 80 bytes).
    debug_assert!((n as u64) < 1 << (64 - Header::SPANS_SHIFT));
    let wide = spans.clone().any(|s| s.strides[ndim..].iter().any(|&x| x != 0));
    let header = Header { ndim, dtypes, wide, spans: n };
    out.reserve(header.words());
    // Word by word: `extend_from_slice` of a few words calls `memcpy`,
    // which cost more than the copy where every rank's program is derived.
    out.push(header.word());
    block.offset().iter().chain(block.extent()).for_each(|&w| out.push(w));
    let strides = header.strides();
    for s in spans {
        out.push(u64::from(s.buffer));
        out.push(s.base);
        s.strides[..strides].iter().for_each(|&w| out.push(w));
    }
}
/// One packed piece, read in place: its header, decoded once, and its words.
#[derive(Clone, Copy)]
pub(super) struct Packed<'a> {
    pub(super) header: Header,
    /// The piece's words, header included.
    pub(super) words: &'a [u64],
}

impl<'a> Packed<'a> {
    #[inline]
    pub(super) fn new(words: &'a [u64]) -> Packed<'a> {
        Packed { header: Header::read(words[0]), words }
    }

    #[inline]
    pub(super) fn block(self) -> Block {
        Block::from_packed(self.header.ndim, &self.words[1..1 + 2 * self.header.ndim])
    }

    #[inline]
    pub(super) fn extent(self) -> &'a [u64] {
        let nd = self.header.ndim;
        &self.words[1 + nd..1 + 2 * nd]
    }

    #[inline]
    pub(super) fn spans(self) -> Spans<'a> {
        Spans { words: &self.words[1 + 2 * self.header.ndim..], strides: self.header.strides() }
    }

    /// The first span (every packed piece of a kind with one has one).
    #[inline]
    pub(super) fn first_span(self) -> Span {
        self.spans().next().unwrap_or_else(|| unreachable!("a piece is packed with its span"))
    }
}

/// The spans of a packed piece, decoded as they are read (nothing is
/// allocated).
#[derive(Clone)]
pub struct Spans<'a> {
    /// The piece's span words: `2 + strides` per span.
    words: &'a [u64],
    /// Strides stored per span.
    strides: usize,
}

impl Iterator for Spans<'_> {
    type Item = Span;

    #[inline]
    fn next(&mut self) -> Option<Span> {
        let (w, rest) = self.words.split_at_checked(2 + self.strides)?;
        self.words = rest;
        // A fixed number of words: no call to `memcpy` per span.
        let mut strides = [0; MAX_DIMS];
        for (d, s) in strides.iter_mut().enumerate() {
            *s = w.get(2 + d).copied().unwrap_or(0);
        }
        // The buffer was packed from a `u32`.
        Some(Span { buffer: w[0] as u32, base: w[1], strides })
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let n = self.words.len() / (2 + self.strides);
        (n, Some(n))
    }
}

impl ExactSizeIterator for Spans<'_> {}

impl fmt::Debug for Spans<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.clone()).finish()
    }
}
impl Pack for SendPiece {
    fn pack(&self, out: &mut Vec<u64>) {
        pack_piece(out, &self.block, [self.wire, self.dtype], std::iter::once(&self.span), 1);
    }

    fn unpack(words: &[u64]) -> SendPiece {
        let p = Packed::new(words);
        SendPiece { block: p.block(), span: p.first_span(), wire: p.header.dtypes[0], dtype: p.header.dtypes[1] }
    }
}

impl Pack for RecvPiece {
    fn pack(&self, out: &mut Vec<u64>) {
        pack_piece(out, &self.block, [self.wire, self.dtype], self.spans.iter(), self.spans.len());
    }

    fn unpack(words: &[u64]) -> RecvPiece {
        let p = Packed::new(words);
        RecvPiece { block: p.block(), spans: p.spans().collect(), wire: p.header.dtypes[0], dtype: p.header.dtypes[1] }
    }
}

impl Pack for LocalCopy {
    fn pack(&self, out: &mut Vec<u64>) {
        let spans = std::iter::once(&self.from).chain(&self.to);
        pack_piece(out, &self.block, [self.from_dtype, self.to_dtype], spans, 1 + self.to.len());
    }

    fn unpack(words: &[u64]) -> LocalCopy {
        let p = Packed::new(words);
        let mut spans = p.spans();
        let from = spans.next().unwrap_or_else(|| unreachable!("a local copy is packed with its source span"));
        LocalCopy { block: p.block(), from, from_dtype: p.header.dtypes[0], to: spans.collect(), to_dtype: p.header.dtypes[1] }
    }
}

/// Each packed piece's words, in order.
#[derive(Clone)]
pub(super) struct Raw<'a> {
    words: &'a [u64],
    left: usize,
}

impl<'a> Raw<'a> {
    /// The `len` pieces packed in `words`.
    #[inline]
    pub(super) fn new(words: &'a [u64], len: usize) -> Raw<'a> {
        Raw { words, left: len }
    }
}

impl<'a> Iterator for Raw<'a> {
    type Item = &'a [u64];

    #[inline]
    fn next(&mut self) -> Option<&'a [u64]> {
        let &h = self.words.first()?;
        let (piece, rest) = self.words.split_at(Header::read(h).words());
        self.words = rest;
        self.left -= 1;
        Some(piece)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.left, Some(self.left))
    }
}

impl ExactSizeIterator for Raw<'_> {}
