//! A count of this process's file descriptors and threads, for leak checks: a test takes
//! one before it starts a job (and whatever it attacks it with) and waits, after, for the
//! same count again. A test that counts must be the only one running in its process (its
//! own test binary), since other tests' sockets and threads count too.

use std::time::{Duration, Instant};

/// Open file descriptors and live threads of this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Census {
    /// Entries of `/proc/self/fd`.
    pub fds: usize,
    /// Entries of `/proc/self/task`.
    pub threads: usize,
}

fn entries(dir: &str) -> usize {
    std::fs::read_dir(dir).map(|d| d.count()).unwrap_or(0)
}

impl Census {
    /// The count now.
    pub fn now() -> Census {
        Census {
            fds: entries("/proc/self/fd"),
            threads: entries("/proc/self/task"),
        }
    }

    /// The count once it equals `self` again, or the count after `within` (threads told to
    /// stop, sockets closed by threads, take a moment to be gone).
    pub fn settled_back(self, within: Duration) -> Census {
        let until = Instant::now() + within;
        loop {
            let c = Census::now();
            if c == self || Instant::now() >= until {
                return c;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}
