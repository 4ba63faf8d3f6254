//! The session's errors, each with a stable [`ErrorKind`] the bindings turn into a C error
//! code or a Python exception class.

use gradwire::ctrl_channel::ChannelError;
use gradwire::transport::TransferError;
use gradwire_collective::error::CollectiveError;

/// Why a session call failed.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    /// Bad arguments or configuration (the message says which and what is allowed).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// This session was closed.
    #[error("the session is closed: create a new one")]
    Closed,
    /// What the collective layer reported.
    #[error(transparent)]
    Collective(#[from] CollectiveError),
}

/// The class of an error, stable across versions: C error codes and Python exception classes
/// come from it.
#[repr(i32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// Bad configuration, buffer length, dtype, rank out of range, loss bound out of range.
    InvalidArgument = 1,
    /// Sockets, addresses, the rendezvous or the endpoint table, authentication (a peer that
    /// refuses a link's handshake: the job secrets, or whether the job is authenticated,
    /// differ; [`SessionError::peer`] names it).
    Setup = 2,
    /// A peer died, timed out or broke the protocol ([`SessionError::peer`] names it).
    Peer = 3,
    /// An earlier operation failed or the session was closed: build a new session.
    Unusable = 4,
    /// A peer sent invalid aggregation data (forged or corrupt contributor sets).
    Data = 5,
    /// A bug: an internal thread panicked.
    Internal = 6,
}

impl ErrorKind {
    /// The C error code (`GW_ERR_*`).
    pub fn code(self) -> i32 {
        self as i32
    }

    /// A short name (`invalid_argument`, `setup`, `peer`, `unusable`, `data`, `internal`).
    pub fn name(self) -> &'static str {
        match self {
            ErrorKind::InvalidArgument => "invalid_argument",
            ErrorKind::Setup => "setup",
            ErrorKind::Peer => "peer",
            ErrorKind::Unusable => "unusable",
            ErrorKind::Data => "data",
            ErrorKind::Internal => "internal",
        }
    }
}

impl SessionError {
    /// The class of this error.
    pub fn kind(&self) -> ErrorKind {
        match self {
            SessionError::InvalidArgument(_) => ErrorKind::InvalidArgument,
            SessionError::Closed => ErrorKind::Unusable,
            SessionError::Collective(e) => match e {
                CollectiveError::Link { source, .. } => match source {
                    TransferError::Config(_) | TransferError::Layout(_) => {
                        ErrorKind::InvalidArgument
                    }
                    TransferError::Random => ErrorKind::Setup,
                    // The handshake refused the link: the ranks' job secrets, or their
                    // authentication modes, differ (a set-up error, as documented).
                    TransferError::Channel(ChannelError::Refused { .. }) => ErrorKind::Setup,
                    _ => ErrorKind::Peer,
                },
                CollectiveError::Aggregate { .. } | CollectiveError::Data { .. } => ErrorKind::Data,
                CollectiveError::Peer { .. } => ErrorKind::Peer,
                CollectiveError::Config(_) | CollectiveError::NoLink { .. } => {
                    ErrorKind::InvalidArgument
                }
                CollectiveError::Job(_) => ErrorKind::InvalidArgument,
                CollectiveError::Setup(_)
                | CollectiveError::PeerSetup { .. }
                | CollectiveError::Rendezvous(_)
                | CollectiveError::Tree(_) => ErrorKind::Setup,
                CollectiveError::Unusable(_) => ErrorKind::Unusable,
                CollectiveError::ThreadPanicked => ErrorKind::Internal,
            },
        }
    }

    /// The peer rank the error is about, when there is one.
    pub fn peer(&self) -> Option<usize> {
        match self {
            SessionError::Collective(
                CollectiveError::Link { peer, .. }
                | CollectiveError::Aggregate { peer, .. }
                | CollectiveError::Peer { peer, .. }
                | CollectiveError::Data { peer, .. }
                | CollectiveError::PeerSetup { peer, .. },
            ) => Some(*peer),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_have_distinct_codes_and_names() {
        let all = [
            ErrorKind::InvalidArgument,
            ErrorKind::Setup,
            ErrorKind::Peer,
            ErrorKind::Unusable,
            ErrorKind::Data,
            ErrorKind::Internal,
        ];
        for (i, a) in all.iter().enumerate() {
            assert_eq!(a.code(), i as i32 + 1);
            for b in &all[i + 1..] {
                assert_ne!(a.name(), b.name());
            }
        }
    }

    #[test]
    fn peer_errors_name_the_peer() {
        let e = SessionError::from(CollectiveError::Link {
            peer: 3,
            source: TransferError::Stalled {
                peer: "198.18.0.4:9".into(),
                timeout: std::time::Duration::from_secs(1),
                during: "waiting for data",
                flow: gradwire::flow::FlowId {
                    job: 1,
                    tensor: 2,
                    round: 0,
                },
            },
        });
        assert_eq!(e.kind(), ErrorKind::Peer);
        assert_eq!(e.peer(), Some(3));
        let bad = SessionError::from(CollectiveError::Link {
            peer: 1,
            source: TransferError::Config("mtu".into()),
        });
        assert_eq!(bad.kind(), ErrorKind::InvalidArgument);
        let refused = SessionError::from(CollectiveError::Link {
            peer: 2,
            source: TransferError::Channel(ChannelError::Refused {
                peer: "198.18.0.3:9".into(),
                reason: "job secret mismatch".into(),
            }),
        });
        assert_eq!(refused.kind(), ErrorKind::Setup);
        assert_eq!(refused.peer(), Some(2));
        assert_eq!(SessionError::Closed.kind(), ErrorKind::Unusable);
        assert_eq!(SessionError::Closed.peer(), None);
    }
}
