//! File and tensor checksums: 64-bit XXH3.
//!
//! XXH3 hashes at tens of GB/s per core, so verifying a checkpoint costs far less than reading
//! it from disk; it detects truncation, torn writes and flipped bits (it is not a defence
//! against a deliberate forger). docs/checkpoint-format.md gives the reasoning.

use xxhash_rust::xxh3::Xxh3;

/// The XXH3-64 of `bytes` (seed 0).
pub fn xxh3(bytes: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(bytes)
}

/// Streaming XXH3-64 over several pieces; equal to [`xxh3`] of their concatenation.
#[derive(Clone)]
pub struct Hasher(Xxh3);

impl Default for Hasher {
    fn default() -> Self {
        Hasher(Xxh3::new())
    }
}

impl Hasher {
    /// A fresh hasher.
    pub fn new() -> Self {
        Self::default()
    }

    /// Feeds bytes.
    pub fn update(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }

    /// The digest of everything fed so far.
    pub fn finish(&self) -> u64 {
        self.0.digest()
    }
}

/// The checksum of a safetensors file as the manifest records it: the XXH3-64 of the
/// little-endian 64-bit XXH3-64 digests of the header (the first `data_start` bytes: length
/// prefix and JSON) and of each tensor's bytes, in file order. The pieces tile the file, so
/// every byte is covered; the tensor digests double as the per-tensor checksums, so a save
/// hashes its data once, and verification hashes tensors in parallel.
pub fn file_checksum(header: u64, tensors: &[u64]) -> u64 {
    let mut h = Hasher::new();
    h.update(&header.to_le_bytes());
    for t in tensors {
        h.update(&t.to_le_bytes());
    }
    h.finish()
}

/// [`file_checksum`] of a whole file's bytes, given where the data section starts and each
/// tensor's `[begin, end)` offsets in it (in file order), hashing the pieces on up to
/// `threads` cores.
pub fn file_checksum_of(
    bytes: &[u8],
    data_start: usize,
    tensors: &[(u64, u64)],
    threads: usize,
) -> u64 {
    let pieces: Vec<&[u8]> = std::iter::once(&bytes[..data_start])
        .chain(
            tensors
                .iter()
                .map(|&(b, e)| &bytes[data_start + b as usize..data_start + e as usize]),
        )
        .collect();
    let sums = digests(&pieces, threads);
    file_checksum(sums[0], &sums[1..])
}

/// The XXH3-64 of each piece, computed on up to `threads` cores (pieces are dealt
/// round-robin so big ones spread over the threads).
pub fn digests(pieces: &[&[u8]], threads: usize) -> Vec<u64> {
    let threads = threads.clamp(1, pieces.len().max(1));
    let mut sums = vec![0u64; pieces.len()];
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|k| {
                s.spawn(move || {
                    (k..pieces.len())
                        .step_by(threads)
                        .map(|i| (i, xxh3(pieces[i])))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        for h in handles {
            for (i, v) in h.join().unwrap_or_default() {
                sums[i] = v;
            }
        }
    });
    sums
}

/// The manifest's text form of a checksum: 16 lower-case hex digits.
pub fn to_hex(sum: u64) -> String {
    format!("{sum:016x}")
}

/// Parses [`to_hex`]'s form.
pub fn from_hex(s: &str) -> Option<u64> {
    (s.len() == 16)
        .then(|| u64::from_str_radix(s, 16).ok())
        .flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streaming_equals_one_shot() {
        let data: Vec<u8> = (0..100_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let mut h = Hasher::new();
        for chunk in data.chunks(777) {
            h.update(chunk);
        }
        assert_eq!(h.finish(), xxh3(&data));
        // The XXH3-64 of the empty input, from the reference implementation.
        assert_eq!(xxh3(b""), 0x2d06800538d394c2);
        assert_eq!(from_hex(&to_hex(xxh3(&data))), Some(xxh3(&data)));
        assert_eq!(from_hex("zz"), None);
    }
}
