//! A flood against rank 0 while a job's ranks join: more idle and slow-loris connections
//! than rank 0 has places for waiting joins, garbage, and headers announcing oversized
//! frames. Every rank still gets the table, in plain and authenticated jobs, and rank 0's
//! file descriptors and threads are what they were before.
//!
//! Its own test binary: it counts the process's descriptors and threads, which other tests
//! running at the same time would change.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use gradwire_netns::census::Census;

use gradwire_proto::auth::{JobKey, JobSecret};
use gradwire_rendezvous::{exchange, RendezvousConfig, MAX_PENDING};

/// The flood: more slow-loris connections than rank 0 has places (a byte every 50 ms each),
/// and, every 50 ms, one connection that sends garbage and one that announces a frame of
/// 4 GiB; until `stop`.
fn flood(master: SocketAddr, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<usize> {
    std::thread::spawn(move || {
        let mut held: Vec<TcpStream> = Vec::new();
        let mut opened = 0;
        let mut tick = 0u64;
        while !stop.load(Ordering::Acquire) {
            // Up to MAX_PENDING + 64 idle and slow connections at once.
            while held.len() < MAX_PENDING + 64 {
                match TcpStream::connect_timeout(&master, Duration::from_millis(200)) {
                    Ok(s) => {
                        s.set_nonblocking(true).unwrap();
                        held.push(s);
                        opened += 1;
                    }
                    Err(_) => break,
                }
            }
            // Every one of them a slow loris: one byte of a join header every 50 ms.
            for s in held.iter_mut() {
                let _ = s.write(&b"GWRV\x01\x01\x00\x00\x01\x00"[(tick % 10) as usize..][..1]);
            }
            for bytes in [&[0xa5u8; 1024][..], &b"GWRV\x01\x01\xff\xff\xff\xff"[..]] {
                if let Ok(mut s) = TcpStream::connect_timeout(&master, Duration::from_millis(200)) {
                    let _ = s.write_all(bytes);
                    opened += 1;
                }
            }
            // Connections rank 0 closed are reopened on the next round.
            held.retain(|s| {
                let mut b = [0u8; 1];
                !matches!(s.peek(&mut b), Ok(0))
            });
            tick += 1;
            std::thread::sleep(Duration::from_millis(50));
        }
        opened
    })
}

fn job(key: Option<Arc<JobKey>>, port: u16) {
    let before = Census::now();
    let pid = std::process::id() & 0x3f_ffff;
    let master = SocketAddr::from((std::net::Ipv4Addr::from(0x7f40_0000 | pid), port));
    let cfg = RendezvousConfig {
        timeout: Duration::from_secs(30),
        key,
        ..RendezvousConfig::default()
    };
    let world = 4;
    let stop = Arc::new(AtomicBool::new(false));
    let r0 = {
        let c = cfg.clone();
        std::thread::spawn(move || exchange(master, 5, 0, world, b"rank 0", &c))
    };
    let flooder = flood(master, stop.clone());
    // The ranks join once the flood fills rank 0's places.
    std::thread::sleep(Duration::from_millis(1500));
    let ranks: Vec<_> = (1..world)
        .map(|r| {
            let c = cfg.clone();
            std::thread::spawn(move || {
                exchange(master, 5, r, world, format!("rank {r}").as_bytes(), &c)
            })
        })
        .collect();
    let want: Vec<Vec<u8>> = (0..world)
        .map(|r| format!("rank {r}").into_bytes())
        .collect();
    let mut got = vec![r0.join().unwrap()];
    got.extend(ranks.into_iter().map(|h| h.join().unwrap()));
    stop.store(true, Ordering::Release);
    let opened = flooder.join().unwrap();
    for (r, g) in got.into_iter().enumerate() {
        assert_eq!(
            g.unwrap_or_else(|e| panic!("rank {r}: {e}")),
            want,
            "rank {r}"
        );
    }
    assert!(
        opened > MAX_PENDING,
        "the flood opened only {opened} connections"
    );
    assert_eq!(
        before.settled_back(Duration::from_secs(5)),
        before,
        "descriptors and threads before and after"
    );
}

#[test]
fn a_flood_during_the_rendezvous_leaves_the_job_and_rank_0_whole() {
    job(None, 7_290);
    let key = Arc::new(JobKey::new(&JobSecret::new(vec![4; 32]).unwrap()));
    job(Some(key), 7_291);
}
