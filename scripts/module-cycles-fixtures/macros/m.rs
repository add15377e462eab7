#[macro_export]
macro_rules! call_n {
    () => {
        $crate::n::work()
    };
}
pub fn helper() {}
