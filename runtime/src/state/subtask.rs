//! [`SubtaskState`]: one value per operator instance.

use rtflow_checkpoint::{Delta, Entry, StateId, StateMeta};
use serde::Serialize;

use super::{encode, Image, StateSnapshot};
use crate::error::Result;

/// One value per operator instance, checkpointed whenever it changed.
pub struct SubtaskState<V> {
    pub(super) id: StateId,
    pub(super) meta: StateMeta,
    pub(super) subtask: u32,
    /// What the checkpoint held for this instance (and for old instances that map
    /// to it after a parallelism change), by old subtask.
    pub(super) restored: Vec<(u32, V)>,
    /// Old instances whose values this one took over: cleared at the first
    /// snapshot, so they are restored only once.
    pub(super) inherited: Vec<u32>,
    pub(super) value: Option<V>,
    pub(super) changed: bool,
    /// Whether `value` was set or cleared since the start: until it is, the
    /// checkpoint holds what this instance restored.
    pub(super) touched: bool,
}

impl<V: Serialize> SubtaskState<V> {
    /// What the checkpoint held, by the subtask that wrote it.
    pub fn restored(&self) -> &[(u32, V)] {
        &self.restored
    }

    /// The value set since the start, if any.
    pub fn get(&self) -> Option<&V> {
        self.value.as_ref()
    }

    /// Sets the value the next snapshot stores.
    pub fn set(&mut self, value: V) {
        self.value = Some(value);
        self.changed = true;
        self.touched = true;
    }

    /// Clears the value; the next snapshot stores its deletion.
    pub fn clear(&mut self) {
        self.value = None;
        self.changed = true;
        self.touched = true;
    }

    /// The value a checkpoint taken now holds for this instance (the values
    /// of old instances it took over are deleted by its first snapshot).
    pub(super) fn image(&self) -> Result<Image> {
        let value = if self.touched {
            self.value.as_ref()
        } else {
            let own = self.restored.iter().find(|(s, _)| *s == self.subtask);
            own.map(|(_, value)| value)
        };
        let entries = match value {
            Some(value) => vec![Entry {
                group: self.subtask,
                key: Vec::new(),
                value: Some(encode(&self.id, value)?),
            }],
            None => Vec::new(),
        };
        Ok(Image::of(&self.id, &self.meta, &entries, false))
    }

    /// Hands the value to `out` if it changed since the last snapshot.
    pub fn snapshot(&mut self, out: &mut StateSnapshot) -> Result<()> {
        let mut entries = Vec::new();
        for old in std::mem::take(&mut self.inherited) {
            if old != self.subtask {
                entries.push(Entry {
                    group: old,
                    key: Vec::new(),
                    value: None,
                });
            }
        }
        if std::mem::take(&mut self.changed) {
            entries.push(Entry {
                group: self.subtask,
                key: Vec::new(),
                value: self
                    .value
                    .as_ref()
                    .map(|v| encode(&self.id, v))
                    .transpose()?,
            });
        }
        out.push(Delta {
            state: self.id.clone(),
            meta: self.meta.clone(),
            part: self.subtask,
            keyed: false,
            entries,
        });
        Ok(())
    }
}
