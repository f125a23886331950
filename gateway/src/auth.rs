//! Token checking. Tokens are stored as SHA-256 hex digests, never in clear,
//! and compared in constant time.

use sha2::{Digest, Sha256};

/// The SHA-256 hex digest of a token, as stored in the config.
pub fn hash_token(token: &str) -> String {
    let digest = Sha256::digest(token.as_bytes());
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

/// Whether `token` hashes to `stored` (a hex digest), in constant time.
pub fn token_matches(token: &str, stored: &str) -> bool {
    let got = hash_token(token);
    let (a, b) = (
        got.as_bytes(),
        stored.trim().to_ascii_lowercase().into_bytes(),
    );
    a.len() == b.len() && a.iter().zip(&b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_matches_only_its_own_digest() {
        let stored = hash_token("s3cret");
        assert_eq!(stored.len(), 64);
        assert!(token_matches("s3cret", &stored));
        assert!(token_matches("s3cret", &stored.to_uppercase()));
        assert!(!token_matches("s3creT", &stored));
        assert!(!token_matches("", &stored));
    }
}
