//! A throw-away TLS certificate for the HTTPS servers of the root tests.

use std::path::PathBuf;
use std::process::Command;

use super::mono_now_ns;

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
        std::fs::create_dir_all(&dir)
            .unwrap_or_else(|e| panic!("cannot create {}: {e}", dir.display()));
        let cert = dir.join("cert.pem");
        let key = dir.join("key.pem");
        let out = Command::new("openssl")
            .args(["req", "-x509", "-newkey", "ec", "-pkeyopt"])
            .arg("ec_paramgen_curve:prime256v1")
            .args(["-nodes", "-days", "2", "-subj", "/CN=localhost", "-keyout"])
            .arg(&key)
            .arg("-out")
            .arg(&cert)
            .output()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot run the openssl CLI ({e}): install it (apt-get install openssl; \
                     `cargo xtask deps` does)"
                )
            });
        assert!(
            out.status.success() && cert.is_file() && key.is_file(),
            "openssl req failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
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
