//! Element types of the tensors a store holds: the workspace's one vocabulary
//! ([`tidestore_dtype`]), re-exported so this crate's users need no second import.

pub use tidestore_dtype::{
    absmax_len, DType, MomentForm, UnknownDType, Q8_BLOCK, Q8_MIN_ELEMENTS, Q8_PLACE_ALIGN_BYTES,
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_dtype_becomes_the_crate_error() {
        let err = "int8".parse::<DType>().unwrap_err();
        assert!(matches!(
            crate::ChunkError::from(err),
            crate::ChunkError::UnknownDType { name } if name == "int8"
        ));
    }
}
