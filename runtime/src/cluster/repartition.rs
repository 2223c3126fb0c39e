//! The operators around a repartition: records are encoded, with their key's
//! hash, before the cluster's topic and decoded after it.

use std::marker::PhantomData;
use std::sync::Arc;

use serde::de::DeserializeOwned;
use serde::Serialize;

use super::Exchanged;
use crate::error::{Result, RtflowError};
use crate::operator::{Collector, Operator};
use crate::record::{Data, Record};

/// The operator family of the steps that encode records for a repartition
/// and decode them after it.
pub(crate) const ENCODE: &str = "repartition_encode";
pub(crate) const DECODE: &str = "repartition_decode";

/// Encodes each record for the repartition topic, with its key's hash.
pub(crate) struct Encode<T> {
    pub(crate) key_hash: Arc<dyn Fn(&T) -> u64 + Send + Sync>,
}

impl<T: Serialize + Send + 'static> Operator<T, Exchanged> for Encode<T> {
    fn allowlisted() -> bool {
        true
    }

    fn process(&mut self, record: Record<T>, out: &mut Collector<'_, Exchanged>) -> Result<()> {
        let key_hash = (self.key_hash)(&record.value);
        let payload = bincode::serde::encode_to_vec(&record.value, bincode::config::standard())
            .map_err(|e| {
                RtflowError::InvalidDataflow(format!(
                    "a record of type {} cannot be encoded for its repartition: {e}",
                    std::any::type_name::<T>()
                ))
            })?;
        out.emit(Exchanged { key_hash, payload })
    }
}

/// Decodes the records read back from the repartition topic.
pub(crate) struct Decode<T>(pub(crate) PhantomData<fn() -> T>);

impl<T: DeserializeOwned + Data> Operator<Exchanged, T> for Decode<T> {
    fn allowlisted() -> bool {
        true
    }

    fn process(&mut self, record: Record<Exchanged>, out: &mut Collector<'_, T>) -> Result<()> {
        let (value, _) =
            bincode::serde::decode_from_slice(&record.value.payload, bincode::config::standard())
                .map_err(|e| RtflowError::ClusterShapeMismatch {
                member: "a writer of the repartition topic".to_owned(),
                difference: format!(
                    "a record it wrote does not decode as {}: {e}",
                    std::any::type_name::<T>()
                ),
            })?;
        out.emit(value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tester::OperatorTester;

    #[test]
    fn records_cross_the_repartition_encoded_with_their_key_hash() {
        let key_hash = Arc::new(|word: &String| word.len() as u64);
        let mut encode =
            OperatorTester::new(ENCODE, |_| Ok(Encode::<String> { key_hash })).unwrap();
        encode.record("four".to_owned(), 40).unwrap();
        let encoded = encode.take_values();
        assert_eq!(encoded[0].key_hash, 4);
        let mut decode =
            OperatorTester::new(DECODE, |_| Ok(Decode::<String>(PhantomData))).unwrap();
        decode.record(encoded[0].clone(), 40).unwrap();
        assert_eq!(decode.take_values(), ["four"]);
    }

    #[test]
    fn a_record_that_cannot_be_encoded_is_an_invalid_dataflow() {
        #[derive(Clone)]
        struct Unencodable;
        impl Serialize for Unencodable {
            fn serialize<S: serde::Serializer>(&self, _: S) -> Result<S::Ok, S::Error> {
                Err(serde::ser::Error::custom("no bytes for this"))
            }
        }
        let key_hash = Arc::new(|_: &Unencodable| 0);
        let mut encode =
            OperatorTester::new(ENCODE, |_| Ok(Encode::<Unencodable> { key_hash })).unwrap();
        let error = encode.record(Unencodable, 0).unwrap_err();
        assert_eq!(error.error_class(), "INVALID_DATAFLOW", "{error}");
        assert!(error.to_string().contains("cannot be encoded"), "{error}");
    }

    #[test]
    fn a_record_another_dataflow_wrote_is_a_shape_mismatch() {
        let mut decode =
            OperatorTester::new(DECODE, |_| Ok(Decode::<(u64, String)>(PhantomData))).unwrap();
        let garbage = Exchanged {
            key_hash: 0,
            payload: vec![0xff; 3],
        };
        let error = decode.record(garbage, 0).unwrap_err();
        assert_eq!(error.error_class(), "CLUSTER_SHAPE_MISMATCH", "{error}");
    }
}
