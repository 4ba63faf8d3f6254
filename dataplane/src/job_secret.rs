//! Where an authenticated job's secret comes from: a key file or the environment, never a
//! command-line value (every user of the host can read another process's arguments in
//! `ps`; the environment and a mode-0600 file are readable by the owner and root only).
//!
//! The secret is opaque bytes, at least
//! [`gradwire_proto::auth::MIN_SECRET_LEN`] (16) of them: make one with
//! `head -c 32 /dev/urandom > job.key && chmod 600 job.key` and give every rank of the job
//! the same file, or export the same `GRADWIRE_JOB_SECRET`. The key schedule built on it is in
//! [`gradwire_proto::auth`].

use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use gradwire_proto::auth::{AuthError, JobKey, JobSecret, MAX_SECRET_LEN};

/// The environment variable holding a job secret (its UTF-8 bytes, as they are).
pub const SECRET_ENV: &str = "GRADWIRE_JOB_SECRET";

/// Why a job secret could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    /// The key file could not be opened or read.
    #[error("job secret file {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The key file is readable or writable by other users.
    #[error(
        "job secret file {path} has mode {mode:03o}, readable or writable by other users: \
         run `chmod 600 {path}`"
    )]
    Permissions {
        /// The file.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
    },
    /// Both sources were given.
    #[error(
        "both a secret file and {SECRET_ENV} are set: use one (unset {SECRET_ENV} or drop \
         --secret-file)"
    )]
    Ambiguous,
    /// The environment variable is not valid Unicode (it is read as UTF-8 text).
    #[error("{SECRET_ENV} is not valid UTF-8: put binary secrets in a file (--secret-file)")]
    NotUnicode,
    /// The secret is too short or too long.
    #[error("job secret from {from}: {source}")]
    Bad {
        /// Where it came from.
        from: String,
        /// What is wrong with it.
        source: AuthError,
    },
}

/// The job key from `file` if given, else from [`SECRET_ENV`] if set; `Ok(None)` when
/// neither: the job is not authenticated. Both set is an error, so a stale variable cannot
/// silently override (or be overridden by) the file the user named.
pub fn load(file: Option<&Path>) -> Result<Option<JobKey>, SecretError> {
    Ok(load_secret(file)?.map(|s| JobKey::new(&s)))
}

/// The job's secret itself, from the same places as [`load`] (for callers that derive
/// several keys from it, such as the collective layer's links).
pub fn load_secret(file: Option<&Path>) -> Result<Option<JobSecret>, SecretError> {
    let env = match std::env::var(SECRET_ENV) {
        Ok(v) => Some(v),
        Err(std::env::VarError::NotPresent) => None,
        Err(std::env::VarError::NotUnicode(_)) => return Err(SecretError::NotUnicode),
    };
    let secret = match (file, env) {
        (Some(_), Some(_)) => return Err(SecretError::Ambiguous),
        (Some(path), None) => read_file(path)?,
        (None, Some(v)) => JobSecret::new(v.into_bytes()).map_err(|source| SecretError::Bad {
            from: SECRET_ENV.into(),
            source,
        })?,
        (None, None) => return Ok(None),
    };
    Ok(Some(secret))
}

/// The secret in a key file: its bytes, less one trailing newline (so `openssl rand -hex 32
/// > job.key` and an editor's final newline work; every rank strips it alike).
pub fn read_file(path: &Path) -> Result<JobSecret, SecretError> {
    let io = |source| SecretError::Io {
        path: path.to_owned(),
        source,
    };
    let f = std::fs::File::open(path).map_err(io)?;
    let mode = f.metadata().map_err(io)?.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(SecretError::Permissions {
            path: path.to_owned(),
            mode,
        });
    }
    // One byte past the limit tells "too long" from "exactly the limit" without reading a
    // huge file into memory.
    let mut bytes = Vec::new();
    f.take(MAX_SECRET_LEN as u64 + 1)
        .read_to_end(&mut bytes)
        .map_err(io)?;
    if bytes.ends_with(b"\r\n") {
        bytes.truncate(bytes.len() - 2);
    } else if bytes.ends_with(b"\n") {
        bytes.truncate(bytes.len() - 1);
    }
    JobSecret::new(bytes).map_err(|source| SecretError::Bad {
        from: path.display().to_string(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_file(name: &str, bytes: &[u8], mode: u32) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("gw-secret-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("job.key");
        std::fs::write(&p, bytes).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
        p
    }

    #[test]
    fn key_file_rules() {
        let ok = temp_file("ok", b"0123456789abcdef0123456789abcdef\n", 0o600);
        let a = read_file(&ok).unwrap();
        // The trailing newline is not part of the secret: same key as without it.
        let no_nl = temp_file("nonl", b"0123456789abcdef0123456789abcdef", 0o400);
        let b = read_file(&no_nl).unwrap();
        let (ka, kb) = (JobKey::new(&a), JobKey::new(&b));
        let t = gradwire_proto::auth::Transcript {
            client_nonce: [5; 32],
            server_nonce: [6; 32],
            client_public: [7; 32],
            server_public: [8; 32],
        };
        assert_eq!(ka.server_proof(&t), kb.server_proof(&t));

        let open = temp_file("open", b"0123456789abcdef0123456789abcdef", 0o644);
        let e = read_file(&open).unwrap_err();
        assert!(
            matches!(e, SecretError::Permissions { mode: 0o644, .. }),
            "{e}"
        );
        assert!(e.to_string().contains("chmod 600"), "{e}");

        let short = temp_file("short", b"tooshort\n", 0o600);
        let e = read_file(&short).unwrap_err();
        assert!(matches!(e, SecretError::Bad { .. }), "{e}");

        let long = temp_file("long", &vec![7u8; MAX_SECRET_LEN + 1], 0o600);
        assert!(matches!(read_file(&long), Err(SecretError::Bad { .. })));

        let e = read_file(Path::new("/nonexistent/gradwire/job.key")).unwrap_err();
        assert!(matches!(e, SecretError::Io { .. }), "{e}");
        for p in [ok, no_nl, open, short, long] {
            let _ = std::fs::remove_dir_all(p.parent().unwrap());
        }
    }
}
