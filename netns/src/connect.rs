//! Connecting to a server that is still starting, typically in another namespace or process.

use std::io;
use std::net::{SocketAddr, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

use crate::error::{NetnsError, Result};

/// Bound on a single connection attempt.
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(1);
/// Pause between attempts. A listener in another process or namespace announces itself by
/// nothing we could wait on, so refused attempts are retried at this pace until the deadline.
const RETRY_PAUSE: Duration = Duration::from_millis(20);

/// Connects to `addr`, retrying refused or failed attempts until `within` has passed. The
/// error names the address, how long it tried and the last attempt's OS error.
pub fn connect_retry(addr: SocketAddr, within: Duration) -> Result<TcpStream> {
    let start = Instant::now();
    let deadline = start + within;
    let mut attempts = 0u32;
    loop {
        attempts += 1;
        let left = deadline.saturating_duration_since(Instant::now());
        // connect_timeout rejects a zero timeout; one last short attempt at the deadline.
        let bound = left.clamp(Duration::from_millis(1), ATTEMPT_TIMEOUT);
        let err = match TcpStream::connect_timeout(&addr, bound) {
            Ok(s) => return Ok(s),
            Err(e) => e,
        };
        let now = Instant::now();
        if now >= deadline {
            return Err(NetnsError::Connect {
                addr,
                waited: now - start,
                attempts,
                source: err,
            });
        }
        if err.kind() != io::ErrorKind::TimedOut {
            thread::sleep(RETRY_PAUSE.min(deadline - now));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{Ipv4Addr, TcpListener};

    #[test]
    fn connects_to_a_listener() {
        let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        let addr = l.local_addr().unwrap();
        let s = connect_retry(addr, Duration::from_secs(5)).unwrap();
        assert_eq!(s.peer_addr().unwrap(), addr);
    }

    #[test]
    fn gives_up_at_the_deadline_naming_address_and_time() {
        // A port that was just free: nothing listens there.
        let addr = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .unwrap()
            .local_addr()
            .unwrap();
        let start = Instant::now();
        let err = connect_retry(addr, Duration::from_millis(200)).unwrap_err();
        let took = start.elapsed();
        assert!(
            took >= Duration::from_millis(200) && took < Duration::from_secs(3),
            "{took:?}"
        );
        let NetnsError::Connect {
            attempts,
            ref source,
            ..
        } = err
        else {
            panic!("{err}");
        };
        assert!(attempts > 1, "{attempts}");
        assert_eq!(source.kind(), io::ErrorKind::ConnectionRefused);
        let msg = err.to_string();
        assert!(
            msg.contains(&addr.to_string()) && msg.contains("ms"),
            "{msg}"
        );
    }
}
