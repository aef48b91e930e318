//! Adam moments decoded from their stored form (fp32 as is, bf16 widened, int8 codes
//! dequantized with the optimizer's maps), for `AdamWCore.moments` (tests, inspection).

use tidestore_chunk::{typed, DType};

/// A moment's stored bytes as `n` f32 values: a Q8 place is the codes, padding to 4
/// bytes, then one fp32 absmax per block; `signed` picks M's map (V's is unsigned).
pub fn decode_moment(bytes: &[u8], dtype: DType, n: usize, signed: bool) -> Vec<f32> {
    let mut out = vec![0.0; n];
    match dtype {
        DType::Q8 => {
            let q = tidestore_optimizer::quant::maps();
            let map = if signed { &q.signed } else { &q.unsigned };
            let blocks = tidestore_optimizer::quant::absmax_len(n);
            let start = n.next_multiple_of(4);
            let mut absmax = vec![0.0f32; blocks];
            typed::decode_f32(&bytes[start..start + 4 * blocks], DType::F32, &mut absmax);
            tidestore_optimizer::quant::dequantize(map, &bytes[..n], &absmax, &mut out);
        }
        d => typed::decode_f32(&bytes[..n * d.size_bytes() as usize], d, &mut out),
    }
    out
}
