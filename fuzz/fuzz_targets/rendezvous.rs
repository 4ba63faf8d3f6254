//! Fuzzes the rendezvous frames (`gradwire_collective::rendezvous::wire`) on raw bytes, as
//! rank 0 and the other ranks see them on the master connection.
//!
//! Properties checked:
//! - no decoder panics, for several `max_payload` bounds (the first input byte picks one);
//! - `decode` agrees with the decoder of the kind the header names, and the others reject
//!   the frame as the wrong kind;
//! - an accepted frame is canonical: re-encoding gives the input bytes exactly, within the
//!   bounds (payloads <= max_payload, world <= MAX_RANKS, reason <= MAX_REASON);
//! - an accepted frame's strict prefixes are rejected as truncated, one more byte as
//!   trailing;
//! - the authenticated job's frames (Hello, Challenge, Sealed) alike; a Sealed frame's inner
//!   frame is one whole Join or Table within the bounds.
#![no_main]

use gradwire_collective::job::MAX_RANKS;
use gradwire_collective::rendezvous::wire::{
    decode, decode_greeting, decode_header, decode_join, decode_refuse, decode_sealed,
    decode_table, encode_greeting, encode_join, encode_refuse, encode_sealed, encode_table, Frame,
    Kind, WireError, HEADER_LEN, MAX_REASON,
};
use libfuzzer_sys::fuzz_target;

const BOUNDS: [usize; 4] = [0, 16, 64 * 1024, usize::MAX];

fuzz_target!(|data: &[u8]| {
    let Some((&pick, frame)) = data.split_first() else {
        return;
    };
    let max_payload = BOUNDS[usize::from(pick) % BOUNDS.len()];

    let header = decode_header(frame, max_payload);
    let any = decode(frame, max_payload);
    let join = decode_join(frame, max_payload);
    let table = decode_table(frame, max_payload);
    let refuse = decode_refuse(frame);

    let Ok(header) = header else {
        assert!(any.is_err() && join.is_err() && table.is_err() && refuse.is_err());
        return;
    };
    // Exactly the decoder of the header's kind may accept; the others say "wrong kind".
    let wrong = |r: Result<(), WireError>, expected: Kind| {
        assert_eq!(
            r,
            Err(WireError::WrongKind {
                expected,
                got: header.kind
            }),
            "decoder for {expected:?} on a {:?} frame",
            header.kind
        );
    };
    match header.kind {
        Kind::Join => {
            assert_eq!(any.clone().ok(), join.clone().ok().map(Frame::Join));
            wrong(table.map(drop), Kind::Table);
            wrong(refuse.map(drop), Kind::Refuse);
        }
        Kind::Table => {
            assert_eq!(any.clone().ok(), table.clone().ok().map(Frame::Table));
            wrong(join.map(drop), Kind::Join);
            wrong(refuse.map(drop), Kind::Refuse);
        }
        Kind::Refuse => {
            assert_eq!(any.clone().ok(), refuse.clone().ok().map(Frame::Refuse));
            wrong(join.map(drop), Kind::Join);
            wrong(table.map(drop), Kind::Table);
        }
        k @ (Kind::Hello | Kind::Challenge) => {
            let g = decode_greeting(frame, k);
            assert_eq!(any.clone().ok(), g.ok().map(|g| Frame::Greeting(k, g)));
            wrong(join.map(drop), Kind::Join);
            wrong(refuse.map(drop), Kind::Refuse);
        }
        Kind::Sealed => {
            let x = decode_sealed(frame, max_payload);
            assert_eq!(any.clone().ok(), x.ok().map(Frame::Sealed));
            wrong(join.map(drop), Kind::Join);
            wrong(table.map(drop), Kind::Table);
        }
    }
    let Ok(msg) = any else {
        return;
    };
    assert_eq!(frame.len(), HEADER_LEN + header.body_len, "accepted length");

    let again = match &msg {
        Frame::Join(j) => {
            assert!(j.world >= 1 && j.world as usize <= MAX_RANKS && j.rank < j.world);
            assert!(j.payload.len() <= max_payload);
            encode_join(j).expect("encode of a decoded join")
        }
        Frame::Table(t) => {
            assert!(!t.payloads.is_empty() && t.payloads.len() <= MAX_RANKS);
            assert!(t.payloads.iter().all(|p| p.len() <= max_payload));
            encode_table(t).expect("encode of a decoded table")
        }
        Frame::Refuse(r) => {
            assert!(r.reason.len() <= MAX_REASON);
            encode_refuse(r)
        }
        Frame::Greeting(k, g) => encode_greeting(*k, g).expect("encode of a decoded greeting"),
        Frame::Sealed(x) => {
            // The inner frame is a whole Join or Table within the bounds.
            let h = decode_header(&x.inner, max_payload).expect("a checked inner frame");
            assert!(matches!(h.kind, Kind::Join | Kind::Table));
            assert_eq!(x.inner.len(), HEADER_LEN + h.body_len);
            encode_sealed(x).expect("encode of a decoded sealed frame")
        }
    };
    assert_eq!(again, frame, "encode(decode(f)) != f for {msg:?}");

    for cut in [
        0,
        HEADER_LEN.min(frame.len()),
        frame.len() / 2,
        frame.len() - 1,
    ] {
        if cut < frame.len() {
            assert!(
                matches!(
                    decode(&frame[..cut], max_payload),
                    Err(WireError::Truncated { .. })
                ),
                "prefix of {cut} bytes accepted"
            );
        }
    }
    let mut longer = frame.to_vec();
    longer.push(0);
    assert_eq!(decode(&longer, max_payload), Err(WireError::Trailing(1)));
});
