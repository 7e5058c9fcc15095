//! The control endpoint's bearer token.
//!
//! `tokentrace run` is root and its control API starts CPU-sampling
//! sessions of the traced servers and hands out their files, so by default
//! only root may use it: without `--control-token-file` the agent makes a
//! random token at start and writes it where only root can read it
//! (`<session dir>/control.token`, mode 0600, in a 0700 directory);
//! `record --remote` on the same host reads it from there. Anyone else
//! gets 401. A non-loopback bind needs an explicit `--control-token-file`
//! (a token the operator distributes), or the agent refuses to start it.

use std::fs;
use std::io::{Read, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

/// Where daemon sessions write unless told otherwise, and so where the
/// generated token lives.
pub const DEFAULT_SESSION_DIR: &str = "/var/lib/tokentrace/sessions";

/// The generated token's file name in the session directory.
pub const TOKEN_FILE_NAME: &str = "control.token";

/// Where `tokentrace run` with default settings keeps its token.
pub fn default_token_path() -> PathBuf {
    Path::new(DEFAULT_SESSION_DIR).join(TOKEN_FILE_NAME)
}

/// Reads a token file (trimmed; empty is an error).
pub fn read_token(path: &Path) -> Result<String> {
    let token = fs::read_to_string(path)
        .with_context(|| format!("reading the control token {}", path.display()))?
        .trim()
        .to_string();
    if token.is_empty() {
        bail!("the control token file {} is empty", path.display());
    }
    Ok(token)
}

/// 32 random bytes from the kernel, in hex.
pub fn generate() -> Result<String> {
    let mut bytes = [0u8; 32];
    fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .context("reading /dev/urandom for the control token")?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// Writes `token` to `dir/control.token`, readable by its owner only, with
/// `dir` made owner-only too (so nobody else can swap files or plant
/// symlinks in it). Returns the file's path.
pub fn write_private(dir: &Path, token: &str) -> Result<PathBuf> {
    fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    fs::set_permissions(dir, fs::Permissions::from_mode(0o700))
        .with_context(|| format!("making {} owner-only", dir.display()))?;
    let path = dir.join(TOKEN_FILE_NAME);
    match fs::remove_file(&path) {
        Ok(()) => {}
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
        Err(err) => return Err(err).with_context(|| format!("replacing {}", path.display())),
    }
    let mut file = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&path)
        .with_context(|| format!("creating {}", path.display()))?;
    writeln!(file, "{token}").with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}

/// The token a client of the control endpoint (`record --remote`, `top
/// --remote`) presents: `token_file`'s content, else
/// `TOKENTRACE_CONTROL_TOKEN`, else the local agent's generated one.
pub fn client_token(token_file: Option<&Path>) -> Result<Option<String>> {
    if let Some(path) = token_file {
        let token = std::fs::read_to_string(path)
            .with_context(|| format!("--token-file {}", path.display()))?;
        return Ok(Some(token.trim().to_string()));
    }
    if let Some(token) = std::env::var("TOKENTRACE_CONTROL_TOKEN")
        .ok()
        .map(|t| t.trim().to_string())
        .filter(|t| !t.is_empty())
    {
        return Ok(Some(token));
    }
    // The agent on this host keeps its generated token root-only.
    let local = default_token_path();
    match read_token(&local) {
        Ok(token) => Ok(Some(token)),
        Err(err) if local.exists() => Err(err.context(
            "the local agent's control token is root-only: run as root, or pass --token-file",
        )),
        Err(_) => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_random_hex_and_stored_owner_only() {
        let (a, b) = (generate().expect("a"), generate().expect("b"));
        assert_eq!(a.len(), 64);
        assert!(a.bytes().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(a, b);
        let dir = std::env::temp_dir().join(format!("tt-token-dir-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let path = write_private(&dir, &a).expect("write");
        let mode = |p: &Path| fs::metadata(p).map(|m| m.permissions().mode() & 0o777).ok();
        assert_eq!(mode(&path), Some(0o600));
        assert_eq!(mode(&dir), Some(0o700));
        assert_eq!(read_token(&path).expect("read"), a);
        // a restart replaces it
        write_private(&dir, &b).expect("rewrite");
        assert_eq!(read_token(&path).expect("read"), b);
        fs::write(&path, "\n").expect("blank");
        assert!(read_token(&path).is_err());
        let _ = fs::remove_dir_all(&dir);
    }
}
