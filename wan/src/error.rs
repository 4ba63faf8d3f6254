//! The runtime's errors: each names the node, the peer or the scheduler, and what to check.

use std::net::SocketAddr;
use std::time::Duration;

/// Why a node or the scheduler failed.
#[derive(Debug, thiserror::Error)]
pub enum WanError {
    /// A chunk channel with a peer failed, or a peer sent what the round's policy forbids.
    /// A peer that failed closes its links, so the nodes whose links had closed before are
    /// named too: one of them may be the cause (a dead node whose death failed the peer),
    /// and so is the node the peer itself named when it gave up.
    #[error(
        "node {rank}: link with node {peer}: {error}{}{}",
        culprit_named(*.culprit),
        closed_before(.closed)
    )]
    Peer {
        /// This node.
        rank: usize,
        /// The peer.
        peer: usize,
        /// What happened.
        error: String,
        /// Nodes whose links to this one had closed before (finished early, or dead).
        closed: Vec<usize>,
        /// The node the peer's own failure names (it gave up its link with this node
        /// because its link with that node failed).
        culprit: Option<usize>,
    },
    /// A round did not finish in time: a node stopped answering, or the network is slower
    /// than the timeout allows.
    #[error(
        "node {rank}: round {round} did not finish within {timeout:?}, the round timeout \
         (waited {waited:.1?}; {pending} chunks still missing; links closed by nodes \
         {closed:?}): a node stopped answering, or raise the timeout"
    )]
    RoundTimeout {
        /// This node.
        rank: usize,
        /// The round.
        round: u32,
        /// Chunks without their result.
        pending: usize,
        /// The timeout.
        timeout: Duration,
        /// How long the node waited, by its own clock (at least `timeout`).
        waited: Duration,
        /// Nodes whose links to this one closed (finished early, or dead).
        closed: Vec<usize>,
    },
    /// A peer or the scheduler broke NetStorm's protocol (a chunk from a node that is not
    /// a child in its tree, a second copy, the wrong version).
    #[error("protocol: {0}")]
    Protocol(String),
    /// The scheduler connection failed, or the scheduler did not answer within the round
    /// timeout (`timed_out`; the message says so).
    #[error("scheduler at {addr}: {error}")]
    Scheduler {
        /// Its address.
        addr: SocketAddr,
        /// What happened.
        error: String,
        /// The configured wait that ran out, when that is what happened.
        timed_out: Option<TimedOut>,
    },
    /// A policy could not be formulated (a disconnected overlay, a bad root).
    #[error("policy formulation: {0}")]
    Plan(String),
    /// Bad configuration.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A thread could not be started, a socket not bound.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// A bug.
    #[error("internal error: {0}")]
    Internal(String),
}

/// A configured wait that ran out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TimedOut {
    /// The configured timeout.
    pub timeout: Duration,
    /// How long the node waited, by its own clock (at least `timeout`).
    pub waited: Duration,
}

impl WanError {
    /// The nodes this error names as a possible cause, ascending: the peer of a failed link,
    /// and the nodes whose links had closed before (one of them may be a dead node whose
    /// death failed the peer); for a round that timed out, the nodes whose links closed.
    /// Tests and reports read this instead of parsing the message.
    pub fn blamed(&self) -> Vec<usize> {
        let mut out = match self {
            WanError::Peer {
                peer,
                closed,
                culprit,
                ..
            } => {
                let mut v = closed.clone();
                v.push(*peer);
                v.extend(*culprit);
                v
            }
            WanError::RoundTimeout { closed, .. } => closed.clone(),
            _ => Vec::new(),
        };
        out.sort_unstable();
        out.dedup();
        out
    }

    /// The configured wait that ran out, when the error is a timeout (a round, or the
    /// scheduler's answer).
    pub fn timed_out(&self) -> Option<TimedOut> {
        match self {
            WanError::RoundTimeout {
                timeout, waited, ..
            } => Some(TimedOut {
                timeout: *timeout,
                waited: *waited,
            }),
            WanError::Scheduler { timed_out, .. } => *timed_out,
            _ => None,
        }
    }
}

/// " (the peer gave up because of node N: see node N)", or nothing.
fn culprit_named(culprit: Option<usize>) -> String {
    culprit.map_or_else(String::new, |c| {
        format!(" (the peer gave up because of node {c}: see node {c})")
    })
}

/// " (links closed before by nodes [..])", or nothing when none had.
fn closed_before(closed: &[usize]) -> String {
    if closed.is_empty() {
        String::new()
    } else {
        format!(" (links closed before by nodes {closed:?})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blamed_and_timed_out_are_the_errors_data() {
        let e = WanError::Peer {
            rank: 0,
            peer: 12,
            error: "closed".into(),
            closed: vec![2, 12],
            culprit: None,
        };
        assert_eq!(e.blamed(), vec![2, 12]);
        assert_eq!(e.timed_out(), None);
        assert_eq!(
            e.to_string(),
            "node 0: link with node 12: closed (links closed before by nodes [2, 12])"
        );
        let e = WanError::Peer {
            rank: 0,
            peer: 3,
            error: "rank 3 gave up message 4".into(),
            closed: vec![],
            culprit: Some(5),
        };
        assert_eq!(e.blamed(), vec![3, 5]);
        assert_eq!(
            e.to_string(),
            "node 0: link with node 3: rank 3 gave up message 4 (the peer gave up because of \
             node 5: see node 5)"
        );
        let e = WanError::RoundTimeout {
            rank: 1,
            round: 2,
            pending: 3,
            timeout: Duration::from_secs(8),
            waited: Duration::from_millis(8_012),
            closed: vec![20, 0],
        };
        assert_eq!(e.blamed(), vec![0, 20]);
        let t = e.timed_out().unwrap();
        assert_eq!(
            (t.timeout, t.waited),
            (Duration::from_secs(8), Duration::from_millis(8_012))
        );
        let m = e.to_string();
        assert!(
            m.contains("did not finish within 8s, the round timeout (waited 8.0s;"),
            "{m}"
        );
        let e = WanError::Scheduler {
            addr: "127.0.0.1:9".parse().unwrap(),
            error: "closed".into(),
            timed_out: None,
        };
        assert!(e.blamed().is_empty() && e.timed_out().is_none());
    }
}
