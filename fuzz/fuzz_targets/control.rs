//! Fuzzes the control channel: `CtrlMsg::decode_body` on the whole input, and the streaming
//! `control::Decoder` on the input cut into arbitrary chunks.
//!
//! Properties checked:
//! - decoding never panics;
//! - the encoding is canonical: a decoded message encodes (`CtrlMsg::encode`) to exactly the
//!   length prefix plus the body it came from, and that decodes back to an equal message;
//! - chunking does not matter: `Decoder` fed the stream in pieces (first 4 input bytes pick the
//!   piece sizes) yields exactly the results of cutting the whole stream into frames and
//!   calling `decode_body` on each, and an oversized length prefix is a sticky `TooLarge`.
#![no_main]

use gradwire_proto::message::{CtrlError, CtrlMsg, Decoder, LEN_PREFIX, MAX_BODY};
use libfuzzer_sys::fuzz_target;

/// Round trip of one successfully decoded body.
fn check_round_trip(body: &[u8], msg: &CtrlMsg) {
    assert_eq!(msg.validate(), Ok(()), "decoded message does not validate");
    assert_eq!(msg.body_len(), body.len(), "body_len of {msg:?}");
    let mut frame = Vec::new();
    assert_eq!(msg.encode(&mut frame), Ok(()), "encode of decoded {msg:?}");
    assert_eq!(frame.len(), LEN_PREFIX + body.len());
    let prefix = u32::try_from(body.len()).unwrap_or(u32::MAX).to_be_bytes();
    assert_eq!(&frame[..LEN_PREFIX], &prefix[..], "length prefix");
    assert_eq!(
        &frame[LEN_PREFIX..],
        body,
        "encode(decode(b)) != b for {msg:?}"
    );
    let again = CtrlMsg::decode_body(&frame[LEN_PREFIX..]);
    assert_eq!(again.as_ref(), Ok(msg), "decode(encode(m)) != m");
}

/// Reference framing: what a correct decoder must yield for the whole stream at once, in
/// order. A final `Err(TooLarge)` ends the stream (the decoder cannot resynchronise).
fn reference(mut stream: &[u8]) -> Vec<Result<CtrlMsg, CtrlError>> {
    let mut out = Vec::new();
    while let Some((prefix, rest)) = stream.split_first_chunk::<LEN_PREFIX>() {
        let len = u32::from_be_bytes(*prefix);
        if len > MAX_BODY {
            out.push(Err(CtrlError::TooLarge(len)));
            break;
        }
        let Some((body, rest)) = rest.split_at_checked(len as usize) else {
            break;
        };
        let res = CtrlMsg::decode_body(body);
        if let Ok(m) = &res {
            check_round_trip(body, m);
        }
        out.push(res);
        stream = rest;
    }
    out
}

fuzz_target!(|data: &[u8]| {
    // 1. The whole input as one body.
    if let Ok(m) = CtrlMsg::decode_body(data) {
        check_round_trip(data, &m);
    }

    // 2. The input after 4 chunk-size bytes as a stream, pushed in pieces.
    let Some((sizes, stream)) = data.split_first_chunk::<4>() else {
        return;
    };
    let expect = reference(stream);
    let mut got: Vec<Result<CtrlMsg, CtrlError>> = Vec::new();
    let mut dec = Decoder::new();
    let mut rest = stream;
    let mut i = 0usize;
    'feed: while !rest.is_empty() {
        // Piece sizes 1..=64, cycling through the 4 size bytes.
        let n = (usize::from(sizes[i % 4]) % 64 + 1).min(rest.len());
        i += 1;
        let (piece, tail) = rest.split_at(n);
        rest = tail;
        dec.push(piece);
        loop {
            match dec.next() {
                Ok(None) => break,
                Ok(Some(m)) => got.push(Ok(m)),
                Err(e @ CtrlError::TooLarge(_)) => {
                    // Sticky: asking again repeats the error and consumes nothing.
                    let buffered = dec.buffered();
                    assert_eq!(dec.next(), Err(e.clone()), "TooLarge not sticky");
                    assert_eq!(dec.buffered(), buffered);
                    got.push(Err(e));
                    break 'feed;
                }
                Err(e) => got.push(Err(e)),
            }
        }
    }
    assert_eq!(
        got, expect,
        "chunked decoding differs from whole-stream framing"
    );
    if !matches!(got.last(), Some(Err(CtrlError::TooLarge(_)))) {
        // Everything not returned is an incomplete frame at the end of the stream.
        let consumed: usize = frame_bytes(stream, got.len());
        assert_eq!(dec.buffered(), stream.len() - consumed, "buffered bytes");
    }
});

/// Bytes taken by the first `frames` frames of `stream` (all complete, sizes <= MAX_BODY).
fn frame_bytes(stream: &[u8], frames: usize) -> usize {
    let mut at = 0usize;
    for _ in 0..frames {
        let mut p = [0u8; LEN_PREFIX];
        p.copy_from_slice(&stream[at..at + LEN_PREFIX]);
        at += LEN_PREFIX + u32::from_be_bytes(p) as usize;
    }
    at
}
