//! Image observations at a byte per value inside the float buffers a backend moves: rows of
//! bytes packed four to a word (issue 44 item 3).

/// Words one row of `width` bytes takes in a float buffer: rows of bytes travel packed four
/// to a word, each row starting at a word ([`pack_byte_rows`]).
pub fn packed_words(width: usize) -> usize {
    width.div_ceil(4)
}

/// Pack `rows` rows of `width` bytes into `words` (`rows · packed_words(width)` floats), each
/// row's bytes in memory order from the start of its first word, so that a buffer of floats
/// carries image observations at a byte per value (the staged batch is one float buffer, as
/// actions travel in it as the bit patterns of their indices). A backend reads the words back
/// as bytes in the same memory order (`bytemuck`'s casts on the CPU, a byte pointer on CUDA).
///
/// # Panics
/// If the lengths disagree: callers size both sides.
pub fn pack_byte_rows(bytes: &[u8], width: usize, words: &mut [f32]) {
    let stride = packed_words(width);
    assert!(width > 0 || bytes.is_empty(), "rows of no bytes");
    let rows = bytes.len().checked_div(width).unwrap_or(0);
    assert_eq!((rows * width, rows * stride), (bytes.len(), words.len()), "pack_byte_rows: shapes");
    let out: &mut [u8] = bytemuck::cast_slice_mut(words);
    if stride * 4 == width {
        out.copy_from_slice(bytes);
        return;
    }
    for (row, out) in bytes.chunks_exact(width).zip(out.chunks_exact_mut(4 * stride)) {
        out[..width].copy_from_slice(row);
        out[width..].fill(0);
    }
}
