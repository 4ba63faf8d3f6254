//! Fuzzes the authenticated data path on raw bytes, as a receiver with authentication on sees
//! them: `header::Packet::new_checked` + `header::Repr::parse` and `auth::FlowKey::open` with
//! a fixed flow key; and the seal/open pair on a datagram derived from the input.
//!
//! Properties checked:
//! - nothing panics on any input;
//! - `open`'s verdict agrees with the header parse: `Malformed(e)` exactly when the parse
//!   fails with `e`, `Unauthenticated` exactly for a Data datagram, otherwise `BadTag` or
//!   success;
//! - open only succeeds for what seal produces: an opened datagram, re-sealed from its header
//!   and plaintext, is the input byte for byte (the fuzzer cannot forge a tag, so in practice
//!   this is never reached from raw input);
//! - for the datagram derived from the input (its first 32 bytes as the header, made AuthData
//!   with a consistent length, the rest as payload): `open(seal(x))` returns x's payload, and
//!   flipping any one bit of the sealed datagram (chosen from the input) makes `open` fail.
#![no_main]

use std::sync::OnceLock;

use gradwire_proto::auth::{
    AuthError, FlowKey, JobKey, JobSecret, Transcript, DATA_TAG_LEN, NONCE_LEN, PUBLIC_LEN,
};
use gradwire_proto::wire::header::{field, Kind, Packet, Repr, HEADER_LEN, VERSION};
use libfuzzer_sys::fuzz_target;

fn key() -> &'static FlowKey {
    static KEY: OnceLock<FlowKey> = OnceLock::new();
    KEY.get_or_init(|| {
        let secret = JobSecret::new(vec![0x42; 32]).expect("32-byte secret");
        JobKey::new(&secret)
            .session(
                &Transcript {
                    client_nonce: [1; NONCE_LEN],
                    server_nonce: [2; NONCE_LEN],
                    client_public: [3; PUBLIC_LEN],
                    server_public: [4; PUBLIC_LEN],
                },
                &[5; 32],
            )
            .flow_key(7, 42, 3, &[9; 16])
    })
}

fuzz_target!(|data: &[u8]| {
    let key = key();
    let mut scratch = Vec::new();

    // Raw input.
    let parsed = Packet::new_checked(data).and_then(|p| Repr::parse(&p));
    match key.open(data, &mut scratch) {
        Ok(plain) => {
            let repr = parsed.expect("an opened datagram parses");
            assert_eq!(repr.kind, Kind::AuthData);
            let mut again = data[..HEADER_LEN].to_vec();
            again.extend_from_slice(plain);
            again.resize(again.len() + DATA_TAG_LEN, 0);
            key.seal(&mut again).expect("re-seal");
            assert_eq!(again, data, "open accepted what seal does not produce");
        }
        Err(AuthError::Malformed(e)) => assert_eq!(parsed, Err(e)),
        Err(AuthError::Unauthenticated) => {
            assert_eq!(parsed.map(|r| r.kind), Ok(Kind::Data));
            assert!(scratch.is_empty());
        }
        Err(AuthError::BadTag) => {
            assert_eq!(parsed.map(|r| r.kind), Ok(Kind::AuthData));
            assert!(
                scratch.is_empty(),
                "nothing left in scratch after a bad tag"
            );
        }
        Err(e) => panic!("open returned {e:?}"),
    }

    // A datagram derived from the input: sealed, it opens to its payload; one flipped bit,
    // and it does not.
    let mut hdr = [0u8; HEADER_LEN];
    let n = data.len().min(HEADER_LEN);
    hdr[..n].copy_from_slice(&data[..n]);
    let payload = data.get(HEADER_LEN..).unwrap_or(&[]);
    let payload = &payload[..payload.len().min(usize::from(u16::MAX))];
    hdr[field::VERSION] = VERSION;
    hdr[field::KIND] = Kind::AuthData as u8;
    hdr[field::LENGTH].copy_from_slice(&(payload.len() as u16).to_be_bytes());
    let mut d = hdr.to_vec();
    d.extend_from_slice(payload);
    d.resize(d.len() + DATA_TAG_LEN, 0);
    key.seal(&mut d)
        .expect("seal of a well-formed AuthData datagram");
    assert_eq!(&d[..HEADER_LEN], &hdr[..], "seal leaves the header alone");
    assert_eq!(key.open(&d, &mut scratch), Ok(payload));
    let pick = data.iter().fold(data.len(), |h, b| {
        h.wrapping_mul(31).wrapping_add(usize::from(*b))
    });
    let bit = pick % (d.len() * 8);
    d[bit / 8] ^= 1 << (bit % 8);
    assert!(
        key.open(&d, &mut scratch).is_err(),
        "bit {bit} flipped and still opened"
    );
});
