//! A throw-away TLS certificate for the HTTPS servers of the root tests
//! and of the bench's TLS section.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

use super::mono_now_ns;

/// A fresh self-signed certificate (P-256, CN=localhost, 2 days) and its
/// key, made with the `openssl` CLI: `dir`/cert.pem and `dir`/key.pem.
pub fn self_signed(dir: &Path) -> Result<(PathBuf, PathBuf)> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let (cert, key) = (dir.join("cert.pem"), dir.join("key.pem"));
    let out = Command::new("openssl")
        .args(["req", "-x509", "-newkey", "ec", "-pkeyopt"])
        .arg("ec_paramgen_curve:prime256v1")
        .args(["-nodes", "-days", "2", "-subj", "/CN=localhost", "-keyout"])
        .arg(&key)
        .arg("-out")
        .arg(&cert)
        .output()
        .context(
            "cannot run the openssl CLI: install it (apt-get install openssl; `cargo xtask deps` does)",
        )?;
    if !(out.status.success() && cert.is_file() && key.is_file()) {
        bail!(
            "openssl req failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok((cert, key))
}

/// A temp dir holding a fresh self-signed certificate and its key (made with
/// the `openssl` CLI); removed on drop.
pub struct TlsDir {
    pub dir: PathBuf,
    cert: PathBuf,
    key: PathBuf,
}

impl TlsDir {
    pub fn new(tag: &str) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "tokentrace-tls-{tag}-{}-{}",
            std::process::id(),
            mono_now_ns()
        ));
        let (cert, key) = self_signed(&dir).unwrap_or_else(|e| panic!("{e:#}"));
        TlsDir { dir, cert, key }
    }

    pub fn cert(&self) -> &str {
        self.cert.to_str().expect("temp path is UTF-8")
    }

    pub fn key(&self) -> &str {
        self.key.to_str().expect("temp path is UTF-8")
    }
}

impl Drop for TlsDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
