//! Consumers that close off the thread that drops them.
//!
//! librdkafka takes about 0.1 s to close a consumer (`rd_kafka_destroy`
//! waits for its broker threads to wind down). A reader is dropped on its
//! actor's thread as a run ends, and a process's next run starts only once
//! every actor of the last one has exited: on a rebalance, every reader's
//! close sat in the pause of the keys that stayed. Nothing waits for what a
//! reader's consumer does while closing (it commits nothing: offsets go
//! with the checkpoint), so the close goes to a thread of its own.

use std::ops::{Deref, DerefMut};

use rdkafka::consumer::{BaseConsumer, ConsumerContext, DefaultConsumerContext};

/// The closing thread's name.
const CLOSE_THREAD: &str = "rtflow-kafka-close";

/// A consumer that, when dropped, closes on a thread of its own.
pub(super) struct ClosingConsumer<C: ConsumerContext + 'static = DefaultConsumerContext>(
    Option<BaseConsumer<C>>,
);

impl<C: ConsumerContext + 'static> ClosingConsumer<C> {
    pub(super) fn new(consumer: BaseConsumer<C>) -> Self {
        Self(Some(consumer))
    }
}

impl<C: ConsumerContext + 'static> Deref for ClosingConsumer<C> {
    type Target = BaseConsumer<C>;

    fn deref(&self) -> &BaseConsumer<C> {
        self.0.as_ref().expect("a consumer until dropped")
    }
}

impl<C: ConsumerContext + 'static> DerefMut for ClosingConsumer<C> {
    fn deref_mut(&mut self) -> &mut BaseConsumer<C> {
        self.0.as_mut().expect("a consumer until dropped")
    }
}

impl<C: ConsumerContext + 'static> Drop for ClosingConsumer<C> {
    fn drop(&mut self) {
        if let Some(consumer) = self.0.take() {
            // Should the thread not start, the closure is dropped here, and
            // with it the consumer: closed in place, as before.
            let _ = std::thread::Builder::new()
                .name(CLOSE_THREAD.into())
                .spawn(move || drop(consumer));
        }
    }
}
