//! gradwire's namespace kit: network namespaces, veths, bridges, neighbours, entering a
//! namespace, the reaper and stale cleanup, privilege gates and a bounded TCP connect retry.
//! Every test, the demo, `gradwire bench`, the fabric's testbeds and the experiments build
//! their namespaces with it; it depends on no other gradwire crate.
//!
//! | module | what |
//! |---|---|
//! | [`ns`] | names, handles under [`NETNS_DIR`], create/delete, [`enter`], [`run_in_netns`], [`NamespaceSet`] |
//! | [`link`] | [`Veth`] pairs, bridges, [`IpBatch`] (addresses, routes, permanent neighbours), offloads, `tbf` shaping |
//! | [`reaper`] | the [`Reaper`] process and [`cleanup_stale`] |
//! | [`cmd`] | the bounded command runner (`ip`, `ethtool`, `tc`) |
//! | [`testbed`] | [`Testbed`]: N hosts on a veth pair or a bridge |
//! | [`privilege`] | [`is_root`], [`require_root`] and partial skips, `GRADWIRE_REQUIRE_PRIV` |
//! | [`connect`] | [`connect_retry`] |
//! | [`exclusive`] | [`FabricLock`]: one fabric run at a time across tests and processes |
//! | [`census`] | [`census::Census`]: this process's descriptors and threads, for leak checks |
//!
//! # Names
//!
//! Temporary namespaces (tests, the demo, benchmarks, experiments) are named from
//! [`new_netns_prefix`], `gw<pid>t<n>`, followed by `h<i>`, `sw` or `-<node>` (`node` of a-z
//! 0-9): `pid` is the creating process and `n` numbers its groups, so parallel tests and
//! parallel test binaries never collide and leftovers can be attributed to their creator.
//! [`NamespaceSet::temporary`] refuses any other name, so the reaper and [`cleanup_stale`]
//! know every temporary namespace. Persistent namespaces ([`NamespaceSet::persistent`], e.g.
//! `gradwire testbed up`) take whatever prefix their owner chooses; it must not start with
//! `gw` and a digit. `scripts/testbed.sh` uses `gwsh`, which the cleanup never matches.
//!
//! # Teardown rule
//!
//! **Delete every device of a namespace (all but `lo`), then the namespace's handle.**
//! [`delete_netns`] does exactly this, and every teardown path goes through it or repeats it:
//! [`NamespaceSet::down`] and its `Drop` (also while unwinding), the [`Reaper`] script, and
//! [`cleanup_stale`].
//!
//! Why devices first: `ip netns del` only removes the handle under [`NETNS_DIR`]. The
//! namespace itself lives on while anything references it: a thread that entered it, an open
//! handle, or a socket created in it (a socket pins its namespace for its whole life, whichever
//! thread uses it). Its devices live as long as it does, so a veth in a namespace pinned by a
//! leaked socket would keep its peer, its XDP program and its bound AF_XDP sockets, and even an
//! unpinned namespace is destroyed asynchronously, on a kernel work queue, some time after its
//! last reference goes. Deleting a device is synchronous and does not care who holds the
//! namespace: a veth takes its peer with it, XDP programs are detached and AF_XDP sockets
//! unbound before `ip link del` returns. So after teardown no device, program or handle of
//! ours remains, and a namespace still pinned by a socket is an empty shell that disappears
//! when the socket is closed. Join threads and close sockets that entered a namespace before
//! tearing it down anyway, or they keep that shell (and its memory) alive.
//!
//! Teardown is layered so that a failing or killed run leaves nothing behind:
//!
//! 1. [`NamespaceSet::down`] (and [`Testbed::down`]) reports every problem, continuing past
//!    each; `Drop` does the same and prints them. Idempotent.
//! 2. Each group of temporary namespaces starts a [`Reaper`] process that deletes them if this
//!    process dies in any way, SIGKILL included.
//! 3. [`cleanup_stale`], called whenever temporary namespaces are created, deletes temporary
//!    namespaces whose creator pid is gone, for when the reaper was killed too.
//!
//! # External commands
//!
//! The kit drives `ip` (iproute2), `ethtool` and `tc` (`scripts/deps.sh` installs them).
//! Every command is killed after a bound ([`COMMAND_TIMEOUT`] unless told otherwise) and its
//! stderr ends up in the error.
#![forbid(unsafe_code)]

pub mod census;
pub mod cmd;
pub mod connect;
mod error;
pub mod exclusive;
pub mod link;
pub mod ns;
pub mod privilege;
pub mod reaper;
pub mod testbed;

pub use cmd::{exec_in_netns, ip_batch, Cmd, COMMAND_TIMEOUT};
pub use connect::connect_retry;
pub use error::{NetnsError, Result};
pub use exclusive::{FabricLock, FABRIC_LOCK_PATH};
pub use link::{mac_string, IpBatch, Veth, VethEnd};
pub use ns::{
    create_netns, delete_links, delete_netns, enter, namespaces_with_prefix, netns_path,
    new_netns_prefix, run_in_netns, spawn_in_netns, with_netns, NamespaceSet, NETNS_DIR,
};
pub use privilege::{is_root, require_root, skip_part, REQUIRE_PRIV_ENV};
pub use reaper::{cleanup_stale, Reaper};
pub use testbed::{Host, Testbed, TestbedConfig, HOST_IFNAME, MAX_HOSTS, PREFIX_LEN};
