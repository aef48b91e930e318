//! Guards against a read needed soon waiting behind reads needed later: pieces waiting
//! for the queue start in the order of their request's order key (plain submits and
//! writes have key 0), equal keys in submission order, each request's pieces in order.
//! With one piece in flight at a time the completions show the start order.

use tidestore_io::{AlignedBuf, Engine, FaultConfig, IoRequest, MemoryBackend, Op};

const BLOCK: usize = 4096;

fn request(op: Op, offset_pieces: u64, pieces: usize, user_data: u64) -> IoRequest {
    IoRequest {
        op,
        offset_bytes: offset_pieces * BLOCK as u64,
        len_bytes: pieces * BLOCK,
        buf: AlignedBuf::new_zeroed(pieces * BLOCK).unwrap(),
        user_data,
    }
}

#[test]
fn waiting_pieces_start_in_order_of_their_key() {
    let backend = MemoryBackend::new(1 << 20, 1, FaultConfig::none());
    let mut engine = Engine::new(Box::new(backend), BLOCK, true).unwrap();
    engine.submit(request(Op::Write, 0, 16, 99));
    let written = engine.wait().expect("the write completes");
    written.result.expect("write");
    assert!(engine.wait().is_none());

    // Submitted without a flush in between: all wait for the one queue slot.
    let ordered = |engine: &mut Engine, offset, pieces, user_data, order| {
        let len = pieces * BLOCK;
        engine.submit_checksummed_ordered(request(Op::Read, offset, pieces, user_data), len, order);
    };
    ordered(&mut engine, 0, 4, 1, 10); // needed at moment 10
    ordered(&mut engine, 4, 2, 2, 5); // needed sooner: overtakes 1
    engine.submit(request(Op::Read, 6, 1, 3)); // key 0: first
    ordered(&mut engine, 7, 1, 4, 10); // same key as 1: after it
    let mut done = Vec::new();
    while let Some(c) = engine.wait() {
        c.result.expect("read");
        done.push(c.user_data);
    }
    assert_eq!(
        done,
        vec![3, 2, 1, 4],
        "completion order (one piece in flight)"
    );
}
